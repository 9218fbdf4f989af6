"""``decode(logprobs=True)``: the target's log-probability of every generated token, whichever drafter proposed it
and however it was sampled, checked against an uncached forward pass over the whole sequence (the reference
``log_softmax`` at each position, computed independently of the decoder)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_layerskip import PROMPTS, TINY, TINY_MODEL, TINY_PARAMS

from jspec.decode import decode, prepare
from jspec.drafters import ModelDrafter, TreeModelDrafter
from jspec.state import StopReason
from jspec.tree import TreeRule, TreeSpec
from models import llama

DRAFT_CFG = llama.LlamaConfig(
    vocab_size=48, hidden=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, ffn=64, name="tiny-draft"
)
DRAFT_PARAMS = llama.init_random_params(DRAFT_CFG, jax.random.key(5), std=0.1)
DRAFT = llama.make_model(DRAFT_CFG)


def reference_logprobs(prompt: list[int], generated: list[int]) -> np.ndarray:
    seq = jnp.asarray([prompt + generated], jnp.int32)
    t = seq.shape[1]
    logits, _ = llama.forward(TINY, TINY_PARAMS, seq, jnp.arange(t)[None], llama.init_cache(TINY, 1, t))
    lp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
    p = len(prompt)
    return lp[np.arange(p - 1, t - 1), generated]  # position i predicts token i + 1


def reference_top(prompt: list[int], generated: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [T, n], log-probabilities [T, n]) of the n most likely tokens where each generated token was chosen,
    from an uncached forward pass; the lower id first among equal values."""
    seq = jnp.asarray([prompt + generated], jnp.int32)
    t = seq.shape[1]
    logits, _ = llama.forward(TINY, TINY_PARAMS, seq, jnp.arange(t)[None], llama.init_cache(TINY, 1, t))
    lp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))[len(prompt) - 1 : t - 1]
    ids = np.stack([np.lexsort((np.arange(lp.shape[1]), -row))[:n] for row in lp])
    return ids, np.take_along_axis(lp, ids, axis=1)


def check_top(prompt, toks, tops, n):
    assert len(tops) == len(toks) and all(len(alts) == n for alts in tops)
    ids, lps = reference_top(prompt, toks, n)
    assert [[i for i, _ in alts] for alts in tops] == ids.tolist()
    np.testing.assert_allclose([[lp for _, lp in alts] for alts in tops], lps, atol=2e-5, rtol=1e-5)


def _drafters():
    from test_eagle import _rollout_head

    from models.eagle import EagleDrafter

    ecfg, hp = _rollout_head()
    eagle = EagleDrafter(ecfg, max_draft=3)
    return {
        "plain": (None, None, {}),
        "chain": (ModelDrafter(DRAFT), DRAFT_PARAMS, dict(gamma=3)),
        "tree": (
            TreeModelDrafter(DRAFT, TreeSpec((2, 2)), TreeRule.WITHOUT_REPLACEMENT),
            DRAFT_PARAMS,
            dict(goodput=False),
        ),
        "eagle": (eagle, eagle.draft_params(TINY_PARAMS, hp), dict(gamma=3)),
    }


@pytest.mark.parametrize("name", ["plain", "chain", "tree", "eagle"])
def test_logprobs_are_the_targets_own(name):
    drafter, dparams, kw = _drafters()[name]
    # Greedy rows and a sampled row with top-k: the reported log-probability is the model's (temperature 1, no
    # filter), whatever transform the row sampled from.
    out = decode(
        TINY_MODEL, TINY_PARAMS, PROMPTS, drafter=drafter, draft_params=dparams, max_new_tokens=[10, 12, 9],
        temperature=[0.0, 1.3, 0.0], top_k=[0, 5, 0], seed=[1, 2, 3], logprobs=True, top_logprobs=4, **kw,
    )  # fmt: skip
    assert out.logprobs is not None and [len(x) for x in out.logprobs] == out.lengths
    for prompt, toks, lps, tops in zip(PROMPTS, out.tokens, out.logprobs, out.top_logprobs):
        np.testing.assert_allclose(lps, reference_logprobs(prompt, toks), atol=2e-5, rtol=1e-5)
        check_top(prompt, toks, tops, 4)  # the N most likely where each token was chosen, most likely first
    if drafter is not None:
        assert out.stats["accepted"] > 0  # multi-token rounds were exercised
    # Asking for them changes nothing else, and without them there are none.
    plain = decode(
        TINY_MODEL, TINY_PARAMS, PROMPTS, drafter=drafter, draft_params=dparams, max_new_tokens=[10, 12, 9],
        temperature=[0.0, 1.3, 0.0], top_k=[0, 5, 0], seed=[1, 2, 3], **kw,
    )  # fmt: skip
    assert plain.tokens == out.tokens and plain.logprobs is None and plain.top_logprobs is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(logprobs="yes"), "logprobs must be True or False"),
        (dict(top_logprobs=3), "top_logprobs=3 needs logprobs=True"),
        (dict(logprobs=True, top_logprobs=21), r"top_logprobs must be an int in \[0, 20\], got 21"),
        (dict(logprobs=True, top_logprobs=-1), r"top_logprobs must be an int in \[0, 20\]"),
        (dict(logprobs=True, top_logprobs=True), "top_logprobs must be an int"),
        (dict(logprobs=True, top_logprobs=2.0), "top_logprobs must be an int"),
    ],
)
def test_logprobs_flags_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        decode(TINY_MODEL, TINY_PARAMS, PROMPTS, max_new_tokens=2, **kwargs)


@pytest.mark.parametrize("name", ["tree"])  # a chain streams in test_decode_core and the sharded checks
def test_stream_reports_stop_reasons_and_logprobs(name):
    """decode_stream's steps carry each row's stop reason (RUNNING until the step that gives the row its last
    token) and the log-probabilities of the step's tokens; its output() is decode's."""
    drafter, dparams, kw = _drafters()[name]
    kw = dict(
        drafter=drafter, draft_params=dparams, max_new_tokens=[10, 12, 9], temperature=[0.0, 1.3, 0.0],
        top_k=[0, 5, 0], seed=[1, 2, 3], **kw,
    )  # fmt: skip
    first = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, **kw)
    eos = first.tokens[0][4]  # row 0 then stops on EOS by its fifth token, the others may too or run to budget
    # N = 17: past sampling.top_k's max/min passes (k <= 16), on lax.top_k.
    fused = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, eos_ids=[eos], logprobs=True, top_logprobs=17, **kw)
    assert StopReason.EOS in fused.stop_reason
    # The pair compiled ahead of time, as the CLI times a stream (decode_stream compiles at the first steps).
    prepared = prepare(TINY_MODEL, TINY_PARAMS, PROMPTS, eos_ids=[eos], logprobs=True, top_logprobs=17, **kw)
    stream = prepared.stream(prepared.compile_stream())
    with pytest.raises(ValueError, match="not run a step"):
        stream.output()
    toks, lps, tops = [[] for _ in PROMPTS], [[] for _ in PROMPTS], [[] for _ in PROMPTS]
    for chunk in stream:
        for b, row in enumerate(chunk):
            assert len(stream.logprobs[b]) == len(row) == len(stream.top_logprobs[b])
            toks[b] += row
            lps[b] += stream.logprobs[b]
            tops[b] += stream.top_logprobs[b]
            done = len(toks[b]) == len(fused.tokens[b])
            assert (stream.stop_reasons[b] == StopReason.RUNNING) != done
            if done:
                assert stream.stop_reasons[b] == fused.stop_reason[b]
    assert toks == fused.tokens and stream.stop_reasons == fused.stop_reason
    for prompt, t, lp in zip(PROMPTS, toks, lps):
        np.testing.assert_allclose(lp, reference_logprobs(prompt, t), atol=2e-5, rtol=1e-5)
    out = stream.output()
    assert out.tokens == fused.tokens and out.stop_reason == fused.stop_reason and out.logprobs == lps
    assert out.top_logprobs == tops  # the stream's pieces are its state's
    for prompt, t, top, fused_top in zip(PROMPTS, toks, tops, fused.top_logprobs):
        check_top(prompt, t, top, 17)
        check_top(prompt, t, fused_top, 17)
    assert out.stats["rounds"] == fused.stats["rounds"]
