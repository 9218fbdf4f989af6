"""Sharded decoding on 8 fake CPU devices and over two jax.distributed processes, against one device.

Everything multi-device runs in subprocesses (``python tests/sharding_selfcheck.py``), so the fake devices never
reach this process or the rest of the suite. One module fixture runs three jobs, overlapping them on the
two CPU cores: A (meshes 2x4, 4x2, the single-device reference, error messages), B (meshes 8x1, 1x8, the
checkpoint round trip and the per-layer layout) and, once A or B is done, the 2-process x 4-device run. Each
job has a timeout, so a hung collective fails the tests instead of blocking them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TEST_XLA_FLAGS

from sharding.launch import launch

ROOT = Path(__file__).resolve().parents[1]
SELFCHECK = ROOT / "tests" / "sharding_selfcheck.py"
TIMEOUT = 900  # seconds per job; the whole module takes ~2-3 minutes on 2 cores
MESHES_A, MESHES_B = ("2x4", "4x2"), ("8x1", "1x8")
MESHES = MESHES_A + MESHES_B
NGRAM_MESHES = ("2x4",)
PLAIN_MESHES = ("2x4", "8x1")  # 4x2 and 1x8 lay the target out by the same rules: their draft-model decode runs
SAMPLINGS = ("greedy", "sampled")
# Cache layout per mesh for the tiny target (8 query heads, 4 KV heads), preset data_tensor: batch over
# data, KV heads over model, the sequence never; on 1x8 the 4 KV heads cannot split 8 ways (replicated).
CACHE_SPECS = {
    "2x4": "P(None, 'data', 'model')",
    "4x2": "P(None, 'data', 'model')",
    "8x1": "P(None, 'data')",
    "1x8": "P()",
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_PLATFORMS"] = "cpu"  # fake CPU devices even on a machine with accelerators
    # The device count comes from --devices / JSPEC_CPU_DEVICES, never from a stray XLA_FLAGS; the suite's
    # compile-time flags (conftest.py) still apply: these jobs are compile-bound.
    env["XLA_FLAGS"] = TEST_XLA_FLAGS
    return env


def _selfcheck(tmp: Path, name: str, *args: str) -> tuple[subprocess.Popen, Path, Path]:
    out, log = tmp / f"{name}.json", tmp / f"{name}.log"
    cmd = [sys.executable, str(SELFCHECK), *args, "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)
    return proc, out, log


def _collect(job) -> dict:
    proc, out, log = job
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {"error": f"timed out after {TIMEOUT} s:\n{log.read_text()[-3000:]}"}
    if proc.returncode != 0 or not out.exists():
        return {"error": f"exit code {proc.returncode}:\n{log.read_text()[-3000:]}"}
    return json.loads(out.read_text())


def _multiprocess() -> dict:
    cmd = [sys.executable, str(SELFCHECK), "multiprocess"]
    codes, outs = launch(cmd, 2, 4, timeout=TIMEOUT, env=_env(), cwd=str(ROOT), echo=False)
    res: dict = {"codes": codes, "outputs": [o[-3000:] for o in outs], "processes": {}}
    for o in outs:
        for line in o.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[len("RESULT ") :])["multiprocess"]
                res["processes"][r["process"]] = r
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharding")
    a = _selfcheck(tmp, "a", "decode", "errors", "--meshes", ",".join(MESHES_A))
    b = _selfcheck(tmp, "b", "decode", "checkpoint", "unstacked", "--meshes", ",".join(MESHES_B), "--no-reference")
    deadline = time.monotonic() + TIMEOUT
    while a[0].poll() is None and b[0].poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    res_mp = _multiprocess()  # once job A or B is done, overlapping with the tail of the other
    res_a, res_b = _collect(a), _collect(b)
    return {"a": res_a, "b": res_b, "mp": res_mp}


def _ok(res: dict) -> dict:
    if "error" in res:
        pytest.fail(res["error"])
    return res


def _decode(runs, mesh: str) -> dict:
    job = _ok(runs["a" if mesh in MESHES_A else "b"])
    return job["decode"]["meshes"][mesh]


def _reference(runs) -> dict:
    return _ok(runs["a"])["decode"]["reference"]


CASES = [
    (mesh, drafter, s)
    for mesh in MESHES
    for drafter in ("plain", "model", "ngram")
    if (drafter != "ngram" or mesh in NGRAM_MESHES) and (drafter != "plain" or mesh in PLAIN_MESHES)
    for s in SAMPLINGS
]


@pytest.mark.parametrize("mesh,drafter,sampling", CASES)
def test_sharded_tokens_equal_single_device(runs, mesh, drafter, sampling):
    got = _decode(runs, mesh)[drafter]["tokens"][sampling]
    want = _reference(runs)[drafter][sampling]
    assert [len(t) for t in want] == [10, 14, 8, 12, 16, 9, 11, 13]  # the ragged budgets were honoured
    assert got == want


def test_round_by_round_stream_donates_state_and_matches(runs):
    e = _decode(runs, "8x1")["model"]
    assert e["stream_tokens"] == _reference(runs)["model"]["greedy"]
    # every row ran to its budget (see test_sharded_tokens_equal_single_device), and the stream says so
    assert e["stream_stop"] == ["MAX_NEW_TOKENS"] * 8
    assert e["stream_output"] == {"tokens": e["stream_tokens"], "stop": e["stream_stop"]}
    assert e["state_donated"]  # the KV caches were updated in place, not copied, every round


def test_reference_is_lossless_and_speculation_is_exercised(runs):
    ref = _reference(runs)
    # Greedy speculative decoding must reproduce plain greedy decoding, and the drafts must be accepted
    # sometimes on every mesh, or the comparison above would not exercise multi-token commits.
    assert ref["model"]["greedy"] == ref["plain"]["greedy"]
    assert ref["ngram"]["greedy"] == ref["plain"]["greedy"]
    for mesh in MESHES:
        for s in SAMPLINGS:
            assert _decode(runs, mesh)["model"]["accepted"][s] > 0


def test_per_row_seeds_split_with_their_rows(runs):
    """Per-row seeds ([B] keys split over the data axis with their rows) give the single-device tokens."""
    ref = _reference(runs)["model"]
    assert _decode(runs, "2x4")["model"]["tokens"]["row_seeds"] == ref["row_seeds"]
    assert ref["row_seeds"] != ref["sampled"]  # the same sampling settings under other keys: the seeds are used


def _cut_at_end_tokens(rows: list[list[int]], eos: list[int], stops: list[list[int]]) -> tuple[list, list]:
    """What decoding with end tokens must give, from the rows decoded without them: each row up to and including
    its first EOS id or own stop id (stop reason EOS), else whole (its budget)."""
    tokens, reasons = [], []
    for row, ids in zip(rows, stops):
        cut = next((j for j, t in enumerate(row) if t in {*eos, *ids}), None)
        tokens.append(row if cut is None else row[: cut + 1])
        reasons.append("MAX_NEW_TOKENS" if cut is None else "EOS")
    return tokens, reasons


LOGPROB_ATOL = 1e-4  # float32 logits of another batch layout


def test_eos_stop_ids_and_logprobs_match_single_device(runs):
    """8x1, draft model, seeded sampling, logprobs=True, eos_ids and per-row stop_token_ids ([B, E], split over
    the data axis with their rows, one per device): the tokens end where the rows' own ids say, as on one device."""
    s = _decode(runs, "8x1")["stops"]
    base = _reference(runs)["model"]["sampled"]  # the same decode without end tokens, on one device
    assert s["base_tokens"] == base  # the ids were picked from these rows
    eos, stops = s["eos_ids"], s["stop_token_ids"]
    want, reasons = _cut_at_end_tokens(base, eos, stops)
    assert (s["reference_tokens"], s["reference_stop"]) == (want, reasons)  # single-device decode's semantics
    assert (s["tokens"], s["stop"]) == (want, reasons)
    assert s["stop_ids_spec"] == "P('data')"
    # Several rows really ended early: by the EOS id, and by ids of their own (not EOS).
    early = [i for i in range(8) if reasons[i] == "EOS" and len(want[i]) < len(base[i])]
    by_own = [i for i in early if want[i][-1] in stops[i] and want[i][-1] not in eos]
    assert any(want[i][-1] in eos for i in early) and len(by_own) >= 2, (eos, stops, want)
    # The ids differ per row, and ids given to other rows (one or two rows on) would end other rows.
    assert len({tuple(x) for x in stops}) >= 6, stops
    for shift in (1, 2):
        moved = stops[-shift:] + stops[:-shift]
        assert _cut_at_end_tokens(base, eos, moved)[0] != want, shift
    assert s["accepted"] > 0  # multi-token rounds, each scattering several log-probabilities
    # Log-probabilities: one per token, finite, negative, as on one device within LOGPROB_ATOL.
    got, ref = s["logprobs"], s["reference_logprobs"]
    assert [len(x) for x in got] == [len(t) for t in want] == [len(x) for x in ref]
    flat_got, flat_ref = np.concatenate(got), np.concatenate(ref)
    assert np.all(np.isfinite(flat_got)) and np.all(flat_got < -1e-3)  # never an unfilled slot's 0
    np.testing.assert_allclose(flat_got, flat_ref, rtol=0, atol=LOGPROB_ATOL)


def test_request_options_split_with_their_rows(runs):
    """8x1: per-row logit_bias ([B, M]), min_tokens ([B]), penalties ([B] with [B, V] counts) and top-3
    log-probabilities on top of the stop-ids decode, split over the data axis with their rows: the tokens are the
    single-device decode's, and every row keeps its own options (even rows never emit the token they ban, odd rows
    no end token in their first 4)."""
    s = _decode(runs, "8x1")["stops"]
    o, base = s["options"], s["base_tokens"]
    assert (o["tokens"], o["stop"]) == (o["reference_tokens"], o["reference_stop"])
    assert o["bias_ids_spec"] == "P('data')" and o["min_tokens_spec"] == "P('data')"
    eos, stops = s["eos_ids"], s["stop_token_ids"]
    for i, row in enumerate(o["tokens"]):
        if i % 2 == 0:
            assert base[i][0] not in row, i
        else:
            assert not any(t in eos or t in stops[i] for t in row[:4]), i
    assert o["tokens"] != s["tokens"]  # the options changed what was decoded
    # The 3 most likely tokens at every position: the same ids as on one device, log-probabilities within atol.
    got, ref = o["top_logprobs"], o["reference_top_logprobs"]
    assert o["top_ids_spec"] == o["out_counts_spec"] == "P('data')"
    assert [[[t for t, _ in alts] for alts in row] for row in got] == [[[t for t, _ in a] for a in r] for r in ref]
    assert [len(row) for row in got] == [len(t) for t in o["tokens"]]
    flat = lambda rows: np.array([x for row in rows for alts in row for _, x in alts])  # noqa: E731
    np.testing.assert_allclose(flat(got), flat(ref), rtol=0, atol=LOGPROB_ATOL)


def test_tree_drafter_matches_single_device(runs):
    """2x4, a draft-model tree (11 nodes, children sampled without replacement, per-row seeds): the ancestor mask
    on split KV heads, and a cache of exactly cache_need slots (the tree's scratch reserved), as on one device."""
    t = _decode(runs, "2x4")["tree"]
    plain = _reference(runs)["plain"]["greedy"]
    assert t["tokens"] == t["reference_tokens"]
    assert t["tokens"]["greedy"] == plain  # lossless
    mixed, temps = t["tokens"]["mixed"], t["mixed_temperature"]
    assert [mixed[i] for i, x in enumerate(temps) if x == 0] == [plain[i] for i, x in enumerate(temps) if x == 0]
    assert [mixed[i] for i, x in enumerate(temps) if x > 0] != [plain[i] for i, x in enumerate(temps) if x > 0]
    assert [len(r) for r in mixed] == [10, 14, 8, 12, 16, 9, 11, 13]
    assert t["stop"] == {"greedy": ["MAX_NEW_TOKENS"] * 8, "mixed": ["MAX_NEW_TOKENS"] * 8}
    assert t["accepted"]["greedy"] > 0 and t["accepted"]["mixed"] > 0
    # The cache: the longest row's P + N - 1 (15 + 11 - 1) and the tree's nodes but the root, no rounding.
    assert (t["nodes"], t["scratch"]) == (11, 10)
    assert t["cache_need"] == t["slots"] == 25 + 10 and t["reference_slots"] == 128
    assert t["cache_collectives"] == []


@pytest.mark.parametrize("mesh", MESHES)
def test_cache_stays_sharded_and_is_never_gathered(runs, mesh):
    entry = _decode(runs, mesh)
    for drafter in ("plain", "model", "ngram"):
        if drafter not in entry:
            continue
        e = entry[drafter]
        assert e["cache_collectives"] == [], e["cache_collectives"]
        assert e["cache_spec"] == CACHE_SPECS[mesh]
        assert e["seq_spec"] == ("P('data')" if mesh != "1x8" else "P()")
        assert e["collectives"]["decode_loops"] == 1  # the whole decode is one program with one loop


def test_pure_data_parallel_round_moves_no_float_data(runs):
    # On 8x1 nothing of the model is split: a plain round may only reduce per-row bookkeeping (int32 / bool)
    # across the data axis, never activations, logits or cache.
    ops = _decode(runs, "8x1")["plain"]["per_round_ops"]
    assert ops, "expected the loop's 'any row running?' reduction"
    assert all(shape.lstrip("(").startswith(("pred", "s32")) for _op, shape, _n in ops), ops


# The tiny models of the self-check: the target's layers, the draft's (its first layer), K.
TARGET_LAYERS, DRAFT_LAYERS, GAMMA = 2, 1, 3
FLOATS = ("f32", "bf16", "f16", "(f32", "(bf16")


def _float_ops(ops) -> tuple[int, int]:
    """(float collectives, others) of one round, each op counted as often as it runs."""
    fl = sum(n for _op, shape, n in ops if shape.startswith(FLOATS))
    return fl, sum(n for _op, _shape, n in ops) - fl


@pytest.mark.parametrize("drafter", ["plain", "model", "ngram"])
def test_per_round_collectives_are_bounded(runs, drafter):
    """2x4, data_tensor: a model call with heads, MLP and vocabulary split over `model` costs 2 all-reduces per
    layer (after the attention and MLP output projections), 1 for the vocabulary-split embedding lookup and 1
    all-gather of the logits (docs/sharding.md): 2L + 2. A plain round is exactly one such call. A speculative
    round holds two verification shapes (K + 1 tokens, or 1 when no row proposes; both are counted, as branches
    in place), and a draft model's round up to K + 1 draft calls (its catch-up and K proposals, split alike on
    2x4). XLA may combine several into one op, so these are bounds. The rest is the loop's bookkeeping (which row
    runs, per-row counters, over `data`): a budget of 16 ops, a regression guard."""
    ops = _decode(runs, "2x4")[drafter]["per_round_ops"]
    floats, others = _float_ops(ops)
    per_call = lambda layers: 2 * layers + 2  # noqa: E731
    if drafter == "plain":
        reduces = [(shape, n) for op, shape, n in ops if op == "all-reduce" and shape.startswith("f32")]
        gathers = [(shape, n) for op, shape, n in ops if op == "all-gather" and shape.startswith("f32")]
        assert sum(n for _, n in reduces) == 2 * TARGET_LAYERS + 1 and sum(n for _, n in gathers) == 1, ops
    bound = {
        "plain": per_call(TARGET_LAYERS),
        "ngram": 2 * per_call(TARGET_LAYERS),
        "model": 2 * per_call(TARGET_LAYERS) + (GAMMA + 1) * per_call(DRAFT_LAYERS),
    }[drafter]
    assert 0 < floats <= bound, (floats, bound, ops)
    assert others <= 16, (others, ops)


def _unstacked(runs) -> dict:
    return _ok(runs["b"])["unstacked"]


def test_per_layer_layout_decodes_sharded_as_on_one_device(runs):
    """The per-layer layout (unstack_layers(fused=False), target and draft) under a data x tensor mesh and the rules
    table: the tokens of one device in the stacked layout (the layouts agree, greedy and sampled); the cache split
    by the table and never gathered; one loop."""
    u, mesh = _unstacked(runs), "2x4"
    ref = _reference(runs)
    for drafter in ("plain", "model", "ngram"):
        e = u["meshes"][mesh][drafter]
        assert e["tokens"] == {s: ref[drafter][s] for s in SAMPLINGS}, (mesh, drafter)
        assert e["cache_spec"] == CACHE_SPECS[mesh] and e["cache_collectives"] == [], (mesh, drafter, e)
        assert e["decode_loops"] == 1
    assert u["meshes"][mesh]["model"]["tokens"]["greedy"] == ref["plain"]["greedy"]  # lossless in this layout too
    assert u["meshes"][mesh]["wq_spec"] == "P(None, 'model')"  # heads split over the model axis


def test_error_messages(runs):
    errs = _ok(runs["a"])["errors"]
    assert "batch 6 is not divisible by the data axis (data=4)" in errs["indivisible_batch"]
    assert "must be placed on the plan's mesh" in errs["unplaced_params"]


@pytest.mark.parametrize("target", ["4x2", "1x8", "1 device"])
def test_checkpoint_from_2x4_restores_elsewhere(runs, target):
    r = _ok(runs["b"])["checkpoint"]["restored"][target]
    assert r["params_equal"]
    assert r["max_abs_logit_diff"]["target"] < 1e-5 and r["max_abs_logit_diff"]["draft"] < 1e-5
    if target == "4x2":
        assert r["devices"] == 8 and r["wq_spec"] == "P(None, None, 'model')" and r["draft_wq_spec"] == "P()"
    elif target == "1x8":  # the preset is refitted to this mesh: query heads follow the unsplittable KV heads
        assert r["devices"] == 8 and r["wq_spec"] == r["wk_spec"] == "P()"
    else:
        assert r["devices"] == 1 and r["wq_spec"] == "P()"


def test_two_processes_match_single_process(runs):
    mp = runs["mp"]
    assert mp["codes"] == [0, 0], "\n".join(mp["outputs"])
    procs = mp["processes"]
    assert sorted(procs) == [0, 1]
    assert procs[0]["devices"] == 8 and procs[0]["processes"] == 2
    assert procs[0]["rows"] == [0, 1, 2, 3] and procs[1]["rows"] == [4, 5, 6, 7]  # inputs built per process
    for p in (0, 1):  # an odd batch is refused, not replicated into duplicate rows
        assert "batch 7 is not divisible by the data axis" in procs[p].get("indivisible_rows", ""), procs[p]
    assert min(procs[1]["local_device_ids"]) >= 4  # process 1's global device ids (2048.. on CPU)
    ref = _reference(runs)["model"]
    for p in (0, 1):
        for s in (*SAMPLINGS, "row_seeds"):  # row_seeds: each process passed its own rows' seeds
            assert procs[p]["tokens"][s] == ref[s], (p, s)
        # Mesh 1x8: every process passes all 8 rows, decoded once as one batch of 8.
        assert procs[p]["replicated"]["rows"] == list(range(8))
        assert procs[p]["replicated"]["tokens"] == ref["greedy"], p
        # Mesh 4x2 with row blocks 1 and 2 on both processes: 6 rows each, one batch of 8.
        assert procs[p]["shared_blocks"]["rows"] == [list(range(6)), list(range(2, 8))][p]
        assert procs[p]["shared_blocks"]["tokens"] == ref["greedy"], p
    # Process 1's row 0 holds an out-of-vocabulary id: it raises that, process 0 names it (both return).
    assert "prompt 0 has token ids outside" in procs[1]["bad_row"], procs[1]["bad_row"]
    for p in (0, 1):  # parameters spanning both processes re-laid out (replicated) on device
        assert procs[p]["relayout"] == {"wq_spec": "P()", "equal": True}, procs[p]["relayout"]
    for p in (0, 1):  # one seed in one process, per-row seeds in the other: refused in both, naming why
        assert "different decode settings, drafters or kinds of seed" in procs[p]["mixed_seed_kinds"], procs[p]
    for p in (0, 1):  # each process's own rows without process_local=True: refused, not mixed
        assert "process_local=False, but the processes passed different inputs" in procs[p]["mixed_batches"]
    assert "process(es) [1] refused their rows' inputs" in procs[0]["bad_row"], procs[0]["bad_row"]


def test_two_processes_pad_request_options_to_one_width(runs):
    """Process 1's rows ban their greedy first token (logit_bias) under a repetition penalty, process 0's rows
    stop at their greedy third token (a stop id): different [B, M] / [B, E] widths per process, padded to one
    program, and token counts kept in both processes although only process 1's rows ask for a penalty. Both
    processes see the same batch, equal to an unsharded decode of the whole batch with the same per-row options
    (process 0's), and every row's options changed it."""
    mp = runs["mp"]
    assert mp["codes"] == [0, 0], "\n".join(mp["outputs"])
    procs = mp["processes"]
    ref = _reference(runs)["model"]["greedy"]
    opts = [procs[p]["options"] for p in (0, 1)]
    assert "error" not in opts[0] and "error" not in opts[1], opts
    assert opts[0]["tokens"] == opts[1]["tokens"] == opts[0]["reference"]
    banned, stopped = opts[1]["logit_bias_rows"], opts[0]["stop_rows"]
    assert banned == [4, 5, 6, 7] and stopped == [0, 1, 2, 3] and not opts[0]["logit_bias_rows"]
    for r, row in enumerate(opts[0]["tokens"]):
        if r in banned:
            assert ref[r][0] not in row and row != ref[r], r
        else:  # ends at the stop id, emitted (at its third token, or sooner where that token came earlier)
            assert row == ref[r][: ref[r].index(ref[r][2]) + 1] and len(row) < len(ref[r]), r


def test_two_processes_refuse_what_they_disagree_on_and_decode_alone_on_local_meshes(runs):
    mp = runs["mp"]
    assert mp["codes"] == [0, 0], "\n".join(mp["outputs"])
    procs = mp["processes"]
    plain = _reference(runs)["plain"]["greedy"]
    for p in (0, 1):
        # A mesh of the process's own device: decoded locally (other prompts, process_local=False), no gather.
        local = procs[p]["local_mesh"]
        assert local["row"] == (1, 6)[p] and local["tokens"] == [plain[local["row"]]], (p, local)
        # The plan, the parameter layouts and process_local are compared first, whatever else differs.
        for case in ("different_plans", "mixed_process_local", "mixed_max_len"):
            assert "parameter layouts, process_local or max_len" in procs[p][case], (p, case)
        # One seed for the whole batch that differs between processes (per-row seeds may differ).
        assert "different seeds or keys for the whole batch" in procs[p]["different_seeds"], procs[p]
        # process_local=False with other budgets (hence other cache sizes): the inputs are named, not the settings.
        assert "process_local=False, but the processes passed different inputs" in procs[p]["different_budgets"]
        # Rows every process holds (data axis 1) whose prompt / seed differ between the processes.
        assert "different inputs for row(s) [3, 5]" in procs[p]["shared_rows_differ"], procs[p]
    assert "holds devices of process(es) [1] of 2 (this is process 0)" in procs[0]["other_process_mesh"]
    assert "holds devices of process(es) [0] of 2 (this is process 1)" in procs[1]["other_process_mesh"]
