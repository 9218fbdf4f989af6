"""Launch N local processes of one command as a jax.distributed job (CPU testing of multi-host code).

    python -m sharding.launch -n 2 --cpu-devices 4 -- python examples/bench_sharded.py --distributed

Each child gets JSPEC_COORDINATOR (127.0.0.1 and a free port), JSPEC_NUM_PROCESSES, JSPEC_PROCESS_ID and
JSPEC_CPU_DEVICES; the program calls ``sharding.distributed.initialize()`` first. Output lines are prefixed
with the process id. If one child fails or the timeout passes, the others are stopped, so a hung collective
fails the run instead of blocking it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from sharding.distributed import ENV_COORDINATOR, ENV_CPU_DEVICES, ENV_NUM_PROCESSES, ENV_PROCESS_ID


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # already gone (a reused id is another user's: not ours)
        pass


def launch(
    cmd: Sequence[str],
    num_processes: int = 2,
    cpu_devices: int | None = 4,
    *,
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    echo: bool = True,
) -> tuple[list[int], list[str]]:
    """Run ``cmd`` as ``num_processes`` processes; returns (exit codes, captured stdout+stderr per process).

    A child still running at the timeout, or once another child has failed, is killed with every process it
    started (each child leads its own process group: a ``bash -c`` wrapper's Python would otherwise outlive it,
    holding the coordinator port and the output pipe) (exit code -9)."""
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
    port = free_port()
    procs, outputs, threads = [], [[] for _ in range(num_processes)], []
    try:
        # Started inside the try: a Popen that fails (a missing executable, too many processes) must not leave
        # the children already started running, blocked in a collective with the one that never came.
        for i in range(num_processes):
            child_env = dict(os.environ if env is None else env)
            child_env.update(
                {ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(num_processes), ENV_PROCESS_ID: str(i)}
            )
            if cpu_devices:
                child_env[ENV_CPU_DEVICES] = str(cpu_devices)
            p = subprocess.Popen(
                list(cmd),
                env=child_env,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                encoding="utf-8",
                errors="replace",  # a stray non-UTF-8 byte must not kill the reader (and then block the child)
                start_new_session=True,
            )
            procs.append(p)

            def pump(p=p, i=i):
                for line in p.stdout:
                    outputs[i].append(line)
                    if echo:
                        sys.stdout.write(f"[p{i}] {line}")
                        sys.stdout.flush()

            t = threading.Thread(target=pump, daemon=True)
            t.start()
            threads.append(t)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        # Every child's whole group, whether its leader is still running or not (a shell that exited can leave its
        # Python child behind), and on Ctrl-C / an exception too: the children run in sessions of their own, so a
        # signal to the launcher never reaches them, and one blocked in a collective would hold its port forever.
        # (A group's id stays taken while any of its processes lives; one that died out entirely could only be
        # reused after the process ids wrap around, within this launch.)
        for p in procs:
            _kill_group(p)
        for p in procs:
            p.wait()
    for t in threads:
        t.join(timeout=5)
    return [p.returncode for p in procs], ["".join(o) for o in outputs]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--num-processes", type=int, default=2)
    ap.add_argument("--cpu-devices", type=int, default=4, help="fake CPU devices per process (0: leave as is)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before every process is stopped")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command to run in every process")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command given (put it after --)")
    if args.num_processes < 1:
        ap.error(f"-n/--num-processes must be at least 1, got {args.num_processes}")
    codes, _ = launch(cmd, args.num_processes, args.cpu_devices or None, timeout=args.timeout)
    print(f"exit codes: {codes}")
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
