"""Continuous batching: requests dropped into free rows decode exactly as they would alone."""

import pytest
from test_decode_core import DRAFT_PARAMS, DRAFTER, TARGET, TARGET_PARAMS

from jspec import decode as dec
from jspec.serve import Engine

REQUESTS = [[0, 1, 2, 0, 1], [2], [1, 1, 0, 2, 2, 1, 0, 0, 1], [0, 2], [1, 2, 1, 2, 1, 2], [0, 0, 1]]
BUDGETS = [8, 5, 12, 1, 9, 6]


def _serve(engine):
    out, queue, owner = {}, list(range(len(REQUESTS))), {}
    while queue or owner:
        for row in engine.free_rows():
            owner.pop(row, None)
            if queue:
                i = queue.pop(0)
                owner[row] = i
                out[i] = [engine.add(row, REQUESTS[i], BUDGETS[i])]
        if not any(engine.stop_reason(r) == dec.StopReason.RUNNING for r in owner):
            owner = {r: i for r, i in owner.items() if engine.stop_reason(r) == dec.StopReason.RUNNING}
            if not queue:
                break
            continue
        for row, toks in engine.step().items():
            out[owner[row]] += toks
    return [out[i] for i in range(len(REQUESTS))]


@pytest.mark.parametrize("speculative", [False, True])
def test_continuous_batching_matches_single_requests(speculative):
    kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=3) if speculative else {}
    alone = [
        dec.decode(TARGET, TARGET_PARAMS, [r], max_new_tokens=m, **kw).tokens[0] for r, m in zip(REQUESTS, BUDGETS)
    ]
    engine = Engine(TARGET, TARGET_PARAMS, batch=2, max_len=64, **kw)
    assert _serve(engine) == alone


def test_engine_rejects_bad_requests():
    engine = Engine(TARGET, TARGET_PARAMS, batch=1, max_len=16)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add(0, [], 4)
    with pytest.raises(ValueError, match="must fit"):
        engine.add(0, [1, 2], 20)
    engine.add(0, [1, 2], 5)
    with pytest.raises(ValueError, match="still decoding"):
        engine.add(0, [1], 3)
