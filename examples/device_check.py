"""The device check: one command to run whenever a GPU or TPU is at hand (docs/benchmarking.md).

    python examples/device_check.py                   # writes docs/results/device-check-<UTC time>.json
    PYTHONPATH=. python3 examples/device_check.py     # on an image where jspec is not installed

On an accelerator (sized for about 8 minutes on one GPU; random weights of real shapes, built on the device: nothing is
downloaded or carried):
1. greedy speculative tokens equal plain tokens for every drafter kind, at batch 1 and 8 (a small random model
   whose logits are spread apart, matmuls at full f32 precision, so float noise between call shapes cannot flip
   a token);
2. the whole-sequence sampling distribution tests of the suite (toy models: chains and trees) on the device;
3. the cost curve of the target's call, T tokens per row against B rows, for SmolLM2-135M, Llama-3.2-1B and
   Llama-3.1-8B shapes: a plain step (T = 1) and K + 1 verifications (what the goodput controller needs);
4. decode speed with a controlled-acceptance drafter (each proposal right with probability 0.8, whatever the
   weights) against plain decoding, in alternating passes, next to the cost model's prediction from the curve.
On a CPU it runs its CPU half (1, 3 and 4 for the 135M shapes) and says what it skipped. ``--smoke`` is the
suite's seconds-long version (a tiny model, a few drafters).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ACCURACY = 0.8
K = 4
TINY = dict(vocab_size=512, hidden=128, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=16, ffn=256)
DISTRIBUTION_TESTS = (
    "tests/test_decode_core.py::test_whole_sequence_distribution_equals_target",
    "tests/test_tree.py::test_tree_whole_sequence_distribution",
)
SMOKE_KINDS = ("ngram", "eagle-tree")


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="the result file (default docs/results/device-check-<UTC>.json)")
    ap.add_argument("--smoke", action="store_true", help="seconds: a tiny model, a few drafters (the suite's)")
    ap.add_argument("--passes", type=int, default=5, help="timed passes per cell (alternating order)")
    return ap.parse_args(argv)


def tiny_model(seed: int = 0):
    from models.llama import LlamaConfig, init_random_params

    cfg = LlamaConfig(**TINY, name="tiny-random")
    return cfg, init_random_params(cfg, jax.random.key(seed), std=0.1)


def layout(params, backend: str):
    """The layout jspec picks for the platform (per-layer on CPU and GPU, packed for the CPU kernels)."""
    from jspec.loaders import wants_unstacked
    from models.llama import unstack_layers

    return unstack_layers(params) if wants_unstacked("auto", backend) else params


def drafters(cfg, stacked, params) -> dict:
    """Every drafter kind on a random target: name -> (drafter, draft params, prepare options)."""
    from jspec.drafters import DynamicTreeDrafter, ModelDrafter, TreeModelDrafter
    from jspec.ngram import NgramDrafter, NgramTreeDrafter
    from jspec.tree import TreeSpec
    from models import eagle
    from models.draft import draft_config, init_from_target, make_draft_model
    from models.layerskip import LayerSkipDrafter
    from models.llama import is_unstacked, unstack_layers

    dcfg = draft_config(cfg, 1)  # the target's first layer: an early exit, so some proposals are right
    dp = init_from_target(dcfg, stacked)
    dp = unstack_layers(dp) if is_unstacked(params) else dp
    draft = make_draft_model(dcfg)
    head = eagle.EagleDrafter(eagle.EagleConfig(cfg, head_tokens=0), max_draft=K)
    hp = head.draft_params(params, eagle.init_head(head.ecfg, stacked, jax.random.key(1)))
    ls = LayerSkipDrafter(cfg, exit_layer=2, max_draft=K)
    return {
        "ngram": (NgramDrafter(vocab_size=cfg.vocab_size), None, {}),
        "ngram-tree": (NgramTreeDrafter(vocab_size=cfg.vocab_size), None, {}),
        "draft-chain": (ModelDrafter(draft), dp, {}),
        "block-verify": (ModelDrafter(draft), dp, {"block_verify": True}),
        "static-tree": (TreeModelDrafter(draft, TreeSpec((3, 2, 1))), dp, {}),
        "dynamic-tree": (DynamicTreeDrafter(draft, top_k=3, depth=3, budget=10), dp, {}),
        "eagle-chain": (head, hp, {}),
        "eagle-tree": (head.as_tree(TreeSpec((3, 2, 1))), hp, {}),
        "eagle-dynamic-tree": (head.as_dynamic_tree(top_k=3, depth=3, budget=10), hp, {}),
        "layerskip": (ls, ls.draft_params(params), {}),
    }


def prompts(batch: int, vocab: int, length: int = 24, seed: int = 0) -> list[list[int]]:
    """Rows that repeat a short motif (prompt lookup finds continuations) between random ones, ragged."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(batch):
        n = length - (i % 5)
        motif = rng.integers(0, vocab, size=4 + i % 3)
        rows.append(np.resize(motif, n).tolist() if i % 2 == 0 else rng.integers(0, vocab, size=n).tolist())
    return rows


def greedy_section(backend: str, smoke: bool) -> dict:
    from jspec.bench.device_check import greedy_equal

    cfg, stacked = tiny_model()
    params = layout(stacked, backend)
    from models.llama import make_model

    kinds = drafters(cfg, stacked, params)
    if smoke:
        kinds = {k: v for k, v in kinds.items() if k in SMOKE_KINDS}
    out = {}
    for b in (1, 8):
        res = greedy_equal(make_model(cfg), params, kinds, prompts(b, cfg.vocab_size), max_new=24)
        out[f"batch {b}"] = res
    return out


def distribution_section(accelerated: bool) -> dict:
    if not accelerated:
        return {"skipped": "on a CPU the suite runs these tests itself (make test)"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DISTRIBUTION_TESTS]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)) or ".")
    return {
        "command": " ".join(cmd),
        "passed": proc.returncode == 0,
        "seconds": time.perf_counter() - t0,
        "output_tail": (proc.stdout + proc.stderr)[-2000:],
    }


def shapes_for(backend: str, smoke: bool) -> list:
    from models import shapes
    from models.llama import LlamaConfig

    if smoke:
        return [LlamaConfig(**TINY, name="tiny-random")]
    if backend == "cpu":
        return [shapes.SMOLLM2_135M]
    return [shapes.SMOLLM2_135M, shapes.LLAMA_3_2_1B, shapes.LLAMA_3_1_8B]


def speed_section(rec, backend: str, smoke: bool, passes: int) -> dict:
    """Cost curves and the controlled-acceptance decode, per model shape (random weights built on the device)."""
    from jspec.bench import record
    from jspec.bench.device_check import controlled_speed, expected_tokens, forward_costs
    from models.llama import init_random_params, make_model

    accelerated = backend != "cpu"
    batches = (1, 8, 32) if accelerated else (1, 8)
    widths = (1, 2, 3, 5, 9) if accelerated else (1, 5)
    max_new = 64 if accelerated else 32
    out = {}
    for cfg in shapes_for(backend, smoke):
        params = layout(init_random_params(cfg, jax.random.key(0)), backend)
        model = make_model(cfg)
        entry = {"costs": forward_costs(model, params, batches if not smoke else (1,), widths, 256, passes)}
        entry["controlled"] = {}
        for b in (1, 8) if not smoke else (1,):
            cell = f"{cfg.name} batch {b}"
            rec.cell(cell, model=cfg.name, batch=b, accuracy=ACCURACY, k=K)
            rec.config(cell, "plain")
            rec.config(cell, "spec", drafter=f"ControlledDrafter({ACCURACY})", k=K)
            name = rec.ratio(cell, "spec", ["plain"], "spec vs plain")
            res = controlled_speed(
                model, params, prompts(b, cfg.vocab_size, seed=b), max_new, ACCURACY, K, passes,
                lambda i, runs, c=cell: rec.add_pass(c, i, runs), record.run_entry,
            )  # fmt: skip
            costs = entry["costs"].get(b) or forward_costs(model, params, (b,), (1, K + 1), 256, passes)[b]
            verify = costs[K + 1]["relative"] if K + 1 in costs else None
            res["predicted_ratio"] = expected_tokens(ACCURACY, K) / verify if verify else None
            res["predicted_ratio_at_measured_tokens_per_round"] = res["tokens_per_round"] / verify if verify else None
            res["measured_ratio"] = record.summarize(rec.data)[cell]["ratios"][name]
            entry["controlled"][f"batch {b}"] = res
            rec.write()
        out[cfg.name] = entry
        del params
    return out


def main(argv=None) -> int:
    args = parse(argv)
    from jspec.bench import record

    backend = jax.default_backend()
    accelerated = backend in ("gpu", "tpu")
    settings = {"smoke": ["tiny model", "drafters " + ",".join(SMOKE_KINDS)] if args.smoke else [], "k": K}
    settings.update(accuracy=ACCURACY, passes=args.passes, backend=backend)
    out = args.out or os.path.join(record.COMMITTED_DIR, os.path.basename(record.default_path("device-check")))
    rec = record.start("device-check", "examples/device_check.py", argv, settings, out)
    # Full f32 matmuls for the equality checks (a GPU's default TF32 rounds differently per call shape).
    with jax.default_matmul_precision("highest"):
        rec.extra["greedy"] = greedy_section(backend, args.smoke)
    rec.extra["distribution"] = distribution_section(accelerated)
    rec.extra["speed"] = speed_section(rec, backend, args.smoke, args.passes)
    rec.extra["skipped"] = (
        []
        if accelerated
        else [
            "the Llama-3.2-1B and Llama-3.1-8B shapes (an accelerator's: random weights of their size on this CPU "
            "would take minutes per pass)",
            "the sampling distribution tests on the device (the suite runs them on the CPU)",
        ]
    )
    rec.finish()
    path = rec.write()
    bad = [f"{b}: {k}" for b, r in rec.extra["greedy"].items() for k, v in r.items() if not v["equal"]]
    for model_name, entry in rec.extra["speed"].items():
        for b, c in entry["controlled"].items():
            m = c["measured_ratio"]
            print(
                f"{model_name} {b}: speculative / plain {m['median']:.2f}x ({m['min']:.2f}-{m['max']:.2f}), "
                f"predicted {c['predicted_ratio'] or float('nan'):.2f}x; tokens/round {c['tokens_per_round']:.2f} "
                f"(expected {c['expected_tokens_per_round']:.2f})"
            )
    dist = rec.extra["distribution"]
    print("greedy equality:", "all equal" if not bad else f"DIFFERS: {bad}")
    print("distribution tests:", dist.get("skipped") or ("passed" if dist["passed"] else "FAILED"))
    for s in rec.extra["skipped"]:
        print("skipped:", s)
    print(f"wrote {path}")
    return 1 if bad or dist.get("passed") is False else 0


if __name__ == "__main__":
    jnp.zeros(())  # the backend starts here, before any model is built
    sys.exit(main())
