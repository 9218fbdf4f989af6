"""The settings a trainer's run was made with, recorded next to what it saves, so that a rerun under the same name
resumes (or reuses) only a run with the same settings and refuses, by name, one made with others; the resumable
checkpoint manager, and the per-step metrics kept next to each checkpoint.

Used by the three trainers (``eagle``, ``draft``, ``early_exit``): each says which of its arguments do not change
the result (checkpoint frequency, evaluation-only flags, the name that is the output's identity) and what counts
as saved state (a checkpoint, a finished result). The per-step metrics (``save_history`` / ``resumed_history``)
let a resumed run report the whole run's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable

import orbax.checkpoint as ocp


def settings(args_dict: dict, ignore: Iterable[str]) -> dict:
    """``args_dict`` without the keys in ``ignore``, as JSON reads it back (tuples become lists), so that a
    recorded run and this one compare equal when they ran with the same values."""
    ignore = frozenset(ignore)
    return {k: v for k, v in json.loads(json.dumps(args_dict)).items() if k not in ignore}


def has_checkpoint(ckpt_dir: str) -> bool:
    """Whether an ``ocp.CheckpointManager`` directory holds a finished step (a folder named by its number):
    the manager creates its directory before the first save, so an empty one holds nothing to resume."""
    return os.path.isdir(ckpt_dir) and any(name.isdigit() for name in os.listdir(ckpt_dir))


def differences(theirs: dict, mine: dict) -> list[str]:
    """Keys both record with other values, sorted. A key one side lacks is an option added since that run was
    recorded: it ran with that option's default, so it is not compared."""
    return sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])


def refuse_if_different(theirs: dict, mine: dict, holder: str, remedy: str) -> None:
    """SystemExit naming every setting that differs, its recorded value and this run's."""
    differ = differences(theirs, mine)
    if differ:
        what = ", ".join(f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} here" for k in differ)
        raise SystemExit(f"{holder} with other settings ({what}): {remedy}")


def write(path: str, mine: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(mine, f, indent=1)


def check_same_run(
    mine: dict,
    record: str,
    saved: bool,
    *,
    holder: str,
    remedy: str,
    unrecorded: Callable[[], dict | None] | None = None,
) -> None:
    """Refuse saved state made with other settings; record this run's settings where nothing is saved.

    mine: this run's settings (``settings``). record: the JSON file that holds them (``args.json``).
    saved: whether a checkpoint or finished result exists. Without one (a fresh directory, or one left by a run
    that stopped before saving), this run's settings are written to ``record``, replacing any there. With one,
    the settings in ``record`` must equal ``mine`` (SystemExit naming those that differ: ``holder``, the values
    there and here, ``remedy``). Saved state without a record (made before records existed) is compared with
    ``unrecorded()``, the settings it was made with as far as its other files tell, if that gives any
    (``unrecorded`` may also refuse it itself); otherwise it is accepted and this run's settings recorded."""
    if not saved:
        write(record, mine)
        return
    if os.path.isfile(record):
        with open(record) as f:
            theirs = json.load(f)
    else:
        theirs = unrecorded() if unrecorded is not None else None
    if theirs is None:  # nothing to compare with: this run's settings stand for it from now on
        write(record, mine)
        return
    refuse_if_different(theirs, mine, holder, remedy)


def save_history(path: str, step: int, seconds: float, history: list[dict]) -> None:
    """The per-step metrics of steps [0, ``step``) and the training seconds they took, kept next to the
    checkpoint of ``step`` (``resumed_history`` reads them back), written atomically."""
    with open(path + ".tmp", "w") as f:
        json.dump({"step": step, "seconds": seconds, "history": history}, f)
    os.replace(path + ".tmp", path)


def resumed_history(path: str, start: int) -> tuple[list[dict], int, float]:
    """(metrics of steps [0, start), the step they start at, their training seconds) for a run resumed at step
    ``start``, from ``save_history``'s file. The file may be a checkpoint ahead (written before a save that never
    finished): its first ``start`` steps are taken. One that holds fewer steps, or none (a checkpoint made before
    the metrics were kept), gives ([], start, 0.0): the metrics then cover only the steps this run makes."""
    if start == 0:
        return [], 0, 0.0
    try:
        with open(path) as f:
            rec = json.load(f)
        hist, step, seconds = rec["history"], int(rec["step"]), float(rec["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return [], start, 0.0
    if len(hist) < start or step < start:
        return [], start, 0.0
    return hist[:start], 0, seconds * start / step


def no_metrics_line(name: str, from_step: int) -> str:
    """A run's report when it recorded no training step: resumed at its last checkpoint, made before the metrics
    were kept with it (``resumed_history`` gave none), with no step left to run."""
    return (
        f"{name}: no training step recorded (the checkpoint of step {from_step} was made before the metrics were "
        "kept with it, and no step was left to run): no training metrics"
    )


def since_step(from_step: int) -> str:
    """' since step N' for metrics that cover only the steps after a resume at N, else ''."""
    return f" since step {from_step}" if from_step else ""


def checkpoint_manager(out_dir: str) -> ocp.CheckpointManager:
    """The run's ``out_dir/ckpt``: the last checkpoint is kept, saved at the steps the trainer chooses."""
    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(out_dir, "ckpt")),
        options=ocp.CheckpointManagerOptions(max_to_keep=1, save_interval_steps=1),
    )


def restore_latest(mgr: ocp.CheckpointManager, state: dict, total: int) -> tuple[int, dict]:
    """(the step to start at, the state there): ``state`` itself at step 0 when ``mgr`` holds no checkpoint, else
    the latest checkpoint restored into ``state``'s structure (said, with the run's ``total`` steps)."""
    start = mgr.latest_step()
    if start is None:
        return 0, state
    state = mgr.restore(start, args=ocp.args.StandardRestore(state))
    print(f"resumed from step {start}/{total}")
    return start, state
