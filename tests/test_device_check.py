"""The device check (``examples/device_check.py``): its CPU half runs here, and its controlled-acceptance drafter
does what the cost model assumes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from jspec.bench import record
from jspec.bench.device_check import ControlledDrafter, expected_tokens, reference_rows
from jspec.decode import decode
from models.llama import LlamaConfig, init_random_params, make_model

ROOT = Path(__file__).resolve().parents[1]


def test_controlled_drafter_is_right_with_its_accuracy():
    """Under greedy verification a proposal is accepted when it and every one before it are right: position j
    is accepted with probability a^(j+1), and a round yields 1 + a + ... + a^K tokens."""
    cfg = LlamaConfig(vocab_size=64, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn=64)
    model, params = make_model(cfg), init_random_params(cfg, jax.random.key(0), std=0.1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, size=6).tolist() for _ in range(48)]
    plain = decode(model, params, prompts, max_new_tokens=40)
    a, k = 0.7, 3
    ref = reference_rows(prompts, plain.tokens, 128)
    out = decode(model, params, prompts, drafter=ControlledDrafter(a, vocab_size=64), draft_params=ref, gamma=k,
                 max_new_tokens=40, max_len=127)  # fmt: skip
    assert out.tokens == plain.tokens  # greedy: lossless whatever is proposed
    acc, prop = np.array(out.stats["accepted_at"]), np.array(out.stats["proposed_at"])
    n = prop[0]
    assert n > 400
    for j in range(k):  # binomial: 5 standard deviations
        p = a ** (j + 1)
        assert abs(acc[j] / prop[j] - p) < 5 * np.sqrt(p * (1 - p) / prop[j]), (j, acc, prop)
    # Rounds cut by the budget emit fewer tokens than they could: the mean is at most the formula's, and close.
    assert expected_tokens(a, k) - 0.25 < out.stats["tokens_per_round"] <= expected_tokens(a, k) + 0.1


def test_wrong_proposals_are_other_tokens():
    d = ControlledDrafter(0.0, vocab_size=5)
    from jspec.drafters import DraftContext
    from jspec.validate import sampling_params

    ref = np.tile(np.arange(10, dtype=np.int32) % 5, (3, 1))
    ctx = DraftContext(ref, np.array([2, 3, 4]), np.array([4, 4, 1]), sampling_params(3))
    prop = d.propose(ref, None, ctx, jax.random.key(0), 4)
    right = np.stack([ref[i, s : s + 4] for i, s in enumerate([2, 3, 4])])
    assert np.all(np.asarray(prop.tokens) != right) and prop.n_draft.tolist() == [4, 4, 1]


def test_the_cpu_half_runs_and_writes_a_valid_result_file(tmp_path):
    out = tmp_path / "device-check.json"
    cmd = [sys.executable, "examples/device_check.py", "--smoke", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert record.validate(data) == []
    greedy = data["extra"]["greedy"]
    assert set(greedy) == {"batch 1", "batch 8"}
    assert all(v["equal"] for r in greedy.values() for v in r.values()) and greedy["batch 8"]["ngram"]["accepted"] > 0
    assert "skipped" in data["extra"]["distribution"] and len(data["extra"]["skipped"]) == 2
    (entry,) = data["extra"]["speed"].values()
    assert entry["costs"]["1"]["1"]["relative"] == 1.0 and entry["controlled"]["batch 1"]["identical"]
    assert "all equal" in proc.stdout and "skipped:" in proc.stdout
