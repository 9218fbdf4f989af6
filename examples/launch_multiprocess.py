"""Sharded speculative decoding over jax.distributed, as N local processes (CPU testing of multi-host code).

    python examples/launch_multiprocess.py                  # 2 processes x 4 fake CPU devices, mesh 2x4
    python examples/launch_multiprocess.py -n 4 --cpu-devices 2 --mesh 4x2

The parent starts the processes with ``sharding.launch`` (127.0.0.1, a free port, a timeout); every child
runs ``worker()``: the same program a host of a TPU pod slice runs. Each process places the same random
tiny models, builds only its own rows of the batch, runs the jitted sharded decode, and prints the gathered
tokens of the whole batch (identical in every process).
"""

from __future__ import annotations

import argparse
import sys


def worker(mesh_shape: str) -> None:
    from sharding.distributed import initialize

    initialize()  # first: reads JSPEC_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID / _CPU_DEVICES

    import jax
    import numpy as np

    from jspec.drafters import ModelDrafter
    from models.llama import LlamaConfig, init_random_params, make_model, param_logical_axes
    from sharding.distributed import rows_for_process
    from sharding.mesh import make_mesh, parse_shape
    from sharding.placement import shard_params
    from sharding.sharded_decode import make_plan, prepare_sharded

    cfg = LlamaConfig(vocab_size=256, hidden=64, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, ffn=128)
    dcfg = cfg.replace(num_layers=1)
    params = init_random_params(cfg, jax.random.key(0), std=0.1)  # same seed in every process: same weights
    draft = {"embed": params["embed"], "final_norm": params["final_norm"]}
    draft["layers"] = jax.tree.map(lambda w: w[:1], params["layers"])

    mesh = make_mesh(parse_shape(mesh_shape))
    plan = make_plan(
        mesh,
        "data_tensor",
        draft="data",  # draft weights replicated, draft cache split by rows like the target's
        target_axes=param_logical_axes(cfg),
        target_shapes=params,
        draft_axes=param_logical_axes(dcfg),
        draft_shapes=draft,
    )
    tp = shard_params(params, param_logical_axes(cfg), mesh, plan.target)
    dp = shard_params(draft, param_logical_axes(dcfg), mesh, plan.draft_rules)

    batch = 8
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (3, 7, 12, 5, 9, 1, 15, 4)][:batch]
    rows = rows_for_process(plan, batch)  # this process builds only these rows
    decode = prepare_sharded(
        make_model(cfg),
        tp,
        [prompts[i] for i in rows],
        plan=plan,
        drafter=ModelDrafter(make_model(dcfg)),
        draft_params=dp,
        process_local=True,
        gamma=3,
        max_new_tokens=12,
        max_len=48,
    )
    out = decode.run()  # tokens of all rows, gathered into every process
    print(
        f"process {jax.process_index()}/{jax.process_count()}: built rows {rows.tolist()}, devices "
        f"{[d.id for d in jax.local_devices()]} of {jax.device_count()}"
    )
    for i, toks in enumerate(out.tokens):
        print(f"  row {i}: {toks}")
    print(f"  accepted {out.stats['accepted']}/{out.stats['proposed']} proposals")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--num-processes", type=int, default=2)
    ap.add_argument("--cpu-devices", type=int, default=4, help="fake CPU devices per process")
    ap.add_argument("--mesh", default="2x4", help="data x model over all processes' devices")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.mesh)
        return 0
    from sharding.launch import launch

    codes, _ = launch(
        [sys.executable, __file__, "--worker", "--mesh", args.mesh],
        args.num_processes,
        args.cpu_devices,
        timeout=args.timeout,
    )
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
