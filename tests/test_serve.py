"""Continuous batching: requests dropped into free rows decode exactly as they would alone."""

import numpy as np
import pytest
from test_decode_core import DRAFT_PARAMS, DRAFTER, TARGET, TARGET_PARAMS

from jspec import decode as dec
from jspec.serve import Engine

REQUESTS = [[0, 1, 2, 0, 1], [2], [1, 1, 0, 2, 2, 1, 0, 0, 1], [0, 2], [1, 2, 1, 2, 1, 2], [0, 0, 1]]
BUDGETS = [8, 5, 12, 1, 9, 6]


def _serve(engine, logprobs=None, tops=None):
    """Serves every request; with a ``logprobs`` dict, also collects each request's ``last_logprobs`` (and with a
    ``tops`` dict its ``last_top_logprobs``)."""
    out, queue, owner = {}, list(range(len(REQUESTS))), {}
    while queue or owner:
        for row in engine.free_rows():
            owner.pop(row, None)
            while queue:  # a request that ends at its first token leaves the row free for the next one
                i = queue.pop(0)
                owner[row] = i
                out[i] = [engine.add(row, REQUESTS[i], BUDGETS[i])]
                if logprobs is not None:
                    logprobs[i] = list(engine.last_logprobs[row])
                if tops is not None:
                    tops[i] = list(engine.last_top_logprobs[row])
                if engine.stop_reason(row) == dec.StopReason.RUNNING:
                    break
        if not any(engine.stop_reason(r) == dec.StopReason.RUNNING for r in owner):
            owner = {r: i for r, i in owner.items() if engine.stop_reason(r) == dec.StopReason.RUNNING}
            if not queue:
                break
            continue
        for row, toks in engine.step().items():
            out[owner[row]] += toks
            if logprobs is not None:
                assert len(engine.last_logprobs[row]) == len(toks)
                logprobs[owner[row]] += engine.last_logprobs[row]
            if tops is not None:
                assert len(engine.last_top_logprobs[row]) == len(toks)
                tops[owner[row]] += engine.last_top_logprobs[row]
    return [out[i] for i in range(len(REQUESTS))]


@pytest.mark.fast
@pytest.mark.parametrize("speculative", [False, True])
def test_continuous_batching_matches_single_requests(speculative):
    kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=3) if speculative else {}
    alone = [
        dec.decode(TARGET, TARGET_PARAMS, [r], max_new_tokens=m, **kw).tokens[0] for r, m in zip(REQUESTS, BUDGETS)
    ]
    engine = Engine(TARGET, TARGET_PARAMS, batch=2, max_len=64, **kw)
    assert _serve(engine) == alone
    # Several rounds per host sync: the same tokens, fewer steps, and no step runs past a round in which a
    # running row stopped (its row is refilled as early as with one round per step).
    multi = Engine(TARGET, TARGET_PARAMS, batch=2, max_len=64, rounds_per_sync=4, **kw)
    rounds, stepped = [], multi.step
    stops = []

    def step():
        running = [r for r in range(2) if multi.stop_reason(r) == dec.StopReason.RUNNING]
        out = stepped()
        rounds.append(multi.last_rounds)
        stops.append(any(multi.stop_reason(r) != dec.StopReason.RUNNING for r in running))
        return out

    multi.step = step
    assert _serve(multi) == alone
    assert max(rounds) == 4 and all(r == 4 or s for r, s in zip(rounds, stops)), (rounds, stops)
    # Refills happen after the same rounds as with one round per step, so the total rounds match too.
    single_rounds = int(engine.state.stats.loop_rounds)
    assert sum(rounds) == int(multi.state.stats.loop_rounds) == single_rounds and len(rounds) < single_rounds


def test_engine_rejects_bad_requests():
    engine = Engine(TARGET, TARGET_PARAMS, batch=1, max_len=16)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add(0, [], 4)
    with pytest.raises(ValueError, match="must fit"):
        engine.add(0, [1, 2], 20)
    with pytest.raises(ValueError, match="must fit"):  # 2 + 16 tokens: 17 slots, the last token takes none
        engine.add(0, [1, 2], 16)
    # The row, the prompt and the budget are checked, not cast: row -1 would be numpy's last row, 2.5 tokens 2.
    for args, message in (
        ((-1, [1], 3), "row must be an int in \\[0, 1\\)"),
        ((1, [1], 3), "row must be an int"),
        ((0, [[1, 2]], 3), "1-D sequence"),
        ((0, [1.5], 3), "prompt must be integers"),
        ((0, [1], 2.5), "max_new_tokens must be integers"),
    ):
        with pytest.raises(ValueError, match=message):
            engine.add(*args)
    engine.add(0, [1, 2], 5)
    with pytest.raises(ValueError, match="still decoding"):
        engine.add(0, [1], 3)
    with pytest.raises(ValueError, match="row must be an int in \\[0, 1\\)"):
        engine.stop_reason(-1)
    for bad in ({"bucket": 0}, {"rounds_per_sync": 0}, {"bucket": 2.5}, {"rounds_per_sync": 2.5}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} .*must be an int >= 1"):
            Engine(TARGET, TARGET_PARAMS, batch=1, max_len=16, **bad)


def test_engine_fills_its_cache_as_decode_does():
    """A budget of S + 1 - P tokens fits an S-slot engine (the last token is never fed back) and decodes what
    jspec.decode decodes with the same cache."""
    engine = Engine(TARGET, TARGET_PARAMS, batch=1, max_len=16)
    out = [engine.add(0, [1, 2], 15)]
    while engine.stop_reason(0) == dec.StopReason.RUNNING:
        out += engine.step().get(0, [])
    want = dec.decode(TARGET, TARGET_PARAMS, [[1, 2]], max_new_tokens=15, max_len=16)
    assert out == want.tokens[0] and len(out) == 15
    assert engine.stop_reason(0) == want.stop_reason[0] == dec.StopReason.MAX_NEW_TOKENS


def test_engine_takes_adaptive_as_decode_does():
    """adaptive=True is the default policy and False fixed K, in the Engine as in decode (a bool reached the
    loop's config before, and the first round failed on it)."""
    from jspec.adaptive import AdaptiveK

    kw = dict(batch=1, max_len=16, drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=2)
    assert Engine(TARGET, TARGET_PARAMS, adaptive=True, **kw).config.adaptive == AdaptiveK()
    assert Engine(TARGET, TARGET_PARAMS, adaptive=False, **kw).config.adaptive is None
    engine = Engine(TARGET, TARGET_PARAMS, adaptive=True, **kw)
    first = engine.add(0, [2, 0, 1], 6)
    out = [first]
    while engine.stop_reason(0) == dec.StopReason.RUNNING:
        out += engine.step().get(0, [])
    want = dec.decode(TARGET, TARGET_PARAMS, [[2, 0, 1]], max_new_tokens=6).tokens[0]
    assert out == want  # greedy: the same tokens as plain decoding


def test_engine_checks_its_drafter_like_decode():
    """Engine and decode share one check of the draft settings (jspec.validate.check_drafter)."""
    from jspec.drafters import TreeModelDrafter
    from jspec.ngram import NgramDrafter, NgramTreeDrafter
    from jspec.tree import TreeRule, TreeSpec

    tree = TreeModelDrafter(DRAFTER.model, TreeSpec((2, 1)), TreeRule.DETERMINISTIC)
    for kwargs, message in (
        (dict(drafter=DRAFTER, gamma=-1), "gamma"),
        (dict(drafter=NgramDrafter(vocab_size=TARGET.vocab_size + 1)), "vocabulary mismatch"),
        (dict(drafter=tree, block_verify=True), "chains, not trees"),
        (dict(drafter=NgramTreeDrafter(2, 2, vocab_size=TARGET.vocab_size), adaptive=True), "chains, not trees"),
        (dict(block_verify=True), "need a drafter"),
        (dict(drafter=tree, draft_params=DRAFT_PARAMS, gamma=3), "gamma=3, but a tree drafter drafts to its depth, 2"),
        (dict(gamma=2), "gamma=2 needs a drafter"),
        (dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=0), "gamma=0 with a drafter drafts nothing"),
        (dict(drafter=DRAFTER), "ModelDrafter needs draft_params"),
        (dict(batch=0), "batch must be an int >= 1"),
        (dict(max_len=16.5), "max_len must be an int >= 1"),
        (dict(eos_ids=[TARGET.vocab_size]), "eos_ids must be token ids in"),  # the same check_eos as decode
        (dict(eos_ids=[2, True]), "eos_ids must be integers"),  # not the EOS id 1
    ):
        kwargs = {"batch": 1, "max_len": 16, **kwargs}
        with pytest.raises(ValueError, match=message):
            Engine(TARGET, TARGET_PARAMS, **kwargs)


def test_engine_reports_logprobs_of_every_token():
    """With logprobs=True, add() and step() leave each returned token's target log-probability in
    last_logprobs: the values decode(logprobs=True) gives each request alone, several rounds per sync included."""
    kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=3)
    lp = dict(logprobs=True, top_logprobs=2)
    alone = [dec.decode(TARGET, TARGET_PARAMS, [r], max_new_tokens=m, **lp, **kw) for r, m in zip(REQUESTS, BUDGETS)]
    got, tops = {}, {}
    engine = Engine(TARGET, TARGET_PARAMS, batch=2, max_len=64, rounds_per_sync=3, **lp, **kw)
    assert _serve(engine, got, tops) == [o.tokens[0] for o in alone]
    for i, o in enumerate(alone):
        np.testing.assert_allclose(got[i], o.logprobs[0], atol=1e-5, rtol=1e-5)
        assert [[t for t, _ in alts] for alts in tops[i]] == [[t for t, _ in alts] for alts in o.top_logprobs[0]]
        want = [[v for _, v in alts] for alts in o.top_logprobs[0]]
        np.testing.assert_allclose([[v for _, v in alts] for alts in tops[i]], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="top_logprobs=2 needs logprobs=True"):
        Engine(TARGET, TARGET_PARAMS, batch=1, max_len=16, top_logprobs=2)
    assert not Engine(TARGET, TARGET_PARAMS, batch=1, max_len=16).last_logprobs  # off by default
    with pytest.raises(ValueError, match="block_verify must be True or False"):
        Engine(TARGET, TARGET_PARAMS, batch=2, max_len=32, block_verify="no", **kw)
    with pytest.raises(ValueError, match="logprobs must be True or False"):
        Engine(TARGET, TARGET_PARAMS, batch=1, max_len=16, logprobs=1)


def test_engine_pads_prompts_within_its_cache_near_the_context_length():
    """An engine whose max_len runs past the model's context keeps a cache of the context's size; a prompt
    padded to the bucket must fit it (62 tokens in buckets of 48: 96 columns for 64 slots failed to prefill)."""
    import dataclasses

    short = dataclasses.replace(TARGET, max_positions=64)
    engine = Engine(short, TARGET_PARAMS, batch=1, max_len=128, bucket=48)
    assert engine.config.slots == 64
    prompt = [i % 3 for i in range(62)]
    got = [engine.add(0, prompt, 3)]
    while engine.stop_reason(0) == dec.StopReason.RUNNING:
        got += engine.step()[0]
    assert got == dec.decode(short, TARGET_PARAMS, [prompt], max_new_tokens=3).tokens[0]


def test_step_with_no_running_row_runs_nothing():
    """An engine with no request running (fresh, or every request ended) runs no round on step(): {} and
    last_rounds 0, and the round counter stays (it ran a whole round for nobody, and counted it)."""
    engine = Engine(TARGET, TARGET_PARAMS, batch=1, max_len=16)
    assert engine.step() == {} and engine.last_rounds == 0
    assert int(engine.state.stats.loop_rounds) == 0
    engine.add(0, [1, 2], 3)
    while engine.stop_reason(0) == dec.StopReason.RUNNING:
        engine.step()
    rounds = int(engine.state.stats.loop_rounds)
    assert rounds == 2  # the two tokens after the prefill's
    assert engine.step() == {} and engine.last_rounds == 0
    assert int(engine.state.stats.loop_rounds) == rounds


def test_cancel_frees_the_row_and_leaves_the_other_rows_alone():
    """cancel(row) aborts a running request: its row is free at once (no tokens from it in later steps) and
    takes a new request, while the other row's request goes on; every request decodes what it decodes alone."""
    kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=3)

    def alone(prompt, budget):
        return dec.decode(TARGET, TARGET_PARAMS, [prompt], max_new_tokens=budget, **kw).tokens[0]

    engine = Engine(TARGET, TARGET_PARAMS, batch=2, max_len=64, **kw)
    with pytest.raises(ValueError, match="row 0 has no running request to cancel \\(its stop reason is IDLE\\)"):
        engine.cancel(0)
    with pytest.raises(ValueError, match="row must be an int in \\[0, 2\\)"):
        engine.cancel(2)
    a, b, c = (REQUESTS[0], 30), (REQUESTS[2], 12), (REQUESTS[4], 9)
    got_a, got_b = [engine.add(0, *a)], [engine.add(1, *b)]
    out = engine.step()
    got_a, got_b = got_a + out[0], got_b + out[1]
    assert engine.stop_reason(0) == engine.stop_reason(1) == dec.StopReason.RUNNING
    engine.cancel(0)
    assert engine.stop_reason(0) == dec.StopReason.IDLE and engine.free_rows() == [0]
    with pytest.raises(ValueError, match="no running request"):
        engine.cancel(0)
    out = engine.step()
    assert list(out) == [1]  # the cancelled row emits nothing
    got_b += out[1]
    got_c = [engine.add(0, *c)]  # its row takes the next request
    while dec.StopReason.RUNNING in (engine.stop_reason(0), engine.stop_reason(1)):
        out = engine.step()
        got_b, got_c = got_b + out.get(1, []), got_c + out.get(0, [])
    assert got_b == alone(*b) and got_c == alone(*c)
    assert len(got_a) < a[1] and got_a == alone(*a)[: len(got_a)]  # cut short, its tokens until then its own


def test_engine_eos_ends_requests_as_decode_does_with_several_rounds_per_sync():
    """The engine's eos_ids, three rounds per host sync: every request is what decode(eos_ids=...) gives alone."""
    kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=3, eos_ids=[2])
    alone = [dec.decode(TARGET, TARGET_PARAMS, [r], max_new_tokens=m, **kw) for r, m in zip(REQUESTS, BUDGETS)]
    engine = Engine(TARGET, TARGET_PARAMS, batch=2, max_len=64, rounds_per_sync=3, **kw)
    assert _serve(engine) == [a.tokens[0] for a in alone]
    assert sum(a.stop_reason[0] == dec.StopReason.EOS for a in alone) >= 2  # EOS really ended requests


def test_request_stop_token_ids_end_only_their_own_request():
    """add(..., stop_token_ids=[...]) (vLLM's per-request stop ids): that request is its unstopped greedy stream
    cut after the first of its ids, stop reason EOS; the request beside it, with none, runs to its budget."""
    kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=3)
    full = [dec.decode(TARGET, TARGET_PARAMS, [REQUESTS[i]], max_new_tokens=20).tokens[0] for i in (0, 2)]
    stop = full[0][3]  # a token the first request emits after its first few
    cut = full[0].index(stop) + 1
    engine = Engine(TARGET, TARGET_PARAMS, batch=2, max_len=64, max_stop_ids=2, **kw)
    with pytest.raises(ValueError, match="3 stop token ids for one row, more than the 2 this state holds"):
        engine.add(0, REQUESTS[0], 20, stop_token_ids=[0, 1, 2])
    with pytest.raises(ValueError, match="one flat sequence of token ids"):
        engine.add(0, REQUESTS[0], 20, stop_token_ids=[[0]])
    with pytest.raises(ValueError, match=r"in \[0, 3\), got \[3\]"):
        engine.add(0, REQUESTS[0], 20, stop_token_ids=[3])
    got = [[engine.add(0, REQUESTS[0], 20, stop_token_ids=[stop])], [engine.add(1, REQUESTS[2], 20)]]
    while dec.StopReason.RUNNING in (engine.stop_reason(0), engine.stop_reason(1)):
        for row, toks in engine.step().items():
            got[row] += toks
    assert got[0] == full[0][:cut] and engine.stop_reason(0) == dec.StopReason.EOS
    assert got[1] == full[1] and engine.stop_reason(1) == dec.StopReason.MAX_NEW_TOKENS
    assert cut < 20 and stop in full[1]  # the id really cut the first request, and would have cut the second
