"""``python -m jspec serve`` as a real process, and the drafters the command builds: a tree drafter and a trained
drafter (the EAGLE head bundled for SmolLM2) served over HTTP give plain greedy decoding's text.

Each server is started on a free loopback port, waited for until ``/health`` answers (its warm-up compiles
first), asked one chat completion with the official ``openai`` client, then stopped with SIGINT or SIGTERM:
it must drain and exit with code 0 within a bound. The references are ``test_server``'s (one batched
``jspec.decode`` call).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

openai = pytest.importorskip("openai", reason="the serve extra: pip install -e '.[serve]'")

import test_server as _ts  # noqa: E402

from jspec.bench.http_runner import ServerProcess  # noqa: E402
from jspec.server import ServerConfig, ServerThread, build_server  # noqa: E402
from jspec.server.launch import free_port  # noqa: E402

CHATS, MODEL, N = _ts.CHATS, _ts.MODEL, _ts.N
model, reference = _ts.model, _ts.reference  # test_server's fixtures: the model and decode's greedy answers

EXIT_WITHIN_S = 30.0  # from the signal to the process's exit, nothing running


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def _text(model, ids) -> str:
    return model.tokenizer.decode(ids, skip_special_tokens=True)


def _greedy_chat(url: str, chat) -> str:
    r = _client(url).chat.completions.create(model=MODEL, messages=chat, max_tokens=N, temperature=0)
    return r.choices[0].message.content


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, drafter",
    [
        (signal.SIGINT, ["--drafter", "ngram-tree", "--gamma", "3", "--branches", "2"]),  # an n-gram tree
        (signal.SIGTERM, ["--drafter", "eagle", "--tree", "4,1"]),  # the bundled EAGLE head, drafting trees
    ],
    ids=["sigint-ngram-tree", "sigterm-eagle-tree"],
)
def test_serve_process_answers_as_decode_and_exits_cleanly_on_a_signal(
    smollm2_path, model, reference, tmp_path, sig, drafter
):
    args = ["--model", smollm2_path, "--served-model-name", MODEL, *drafter, "--rows", "1", "--max-len", "64",
            "--log-level", "warning"]  # fmt: skip
    cache = os.environ.get("JSPEC_TEST_COMPILE_CACHE")  # conftest's, for this run only
    args += ["--compile-cache", cache] if cache else []
    log = tmp_path / "server.log"
    with ServerProcess(args, free_port(), str(log), start_timeout_s=600) as server:
        assert _greedy_chat(server.url, CHATS[0]) == _text(model, reference[0])
        server.proc.send_signal(sig)
        t0 = time.monotonic()
        try:
            rc = server.proc.wait(EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {EXIT_WITHIN_S} s of {sig.name}; see {log}")
        waited = time.monotonic() - t0
    out = log.read_text()
    assert rc == 0 and server.returncode == 0, out  # (the benchmark records the latter)
    assert "Traceback" not in out, out
    assert waited < EXIT_WITHIN_S


@pytest.fixture(scope="module")
def eagle_chain_url(model):
    """A server in this process over the bundled EAGLE head drafting chains of K = 2, built by its drafter loader
    (the entry point ``python -m jspec serve --drafter eagle`` goes through)."""
    from jspec.loaders import model_loader

    drafter, dparams = model_loader("jspec.drafter_loaders", "eagle")(None, model, 2)
    cfg = ServerConfig(MODEL, rows=2, max_len=256, max_logprobs=None, warmup=False)
    tok = model.tokenizer
    server = build_server(model.model, model.params, tok, cfg, drafter=drafter, draft_params=dparams, gamma=2,
                          eos_ids=tok.eos_ids)  # fmt: skip
    with ServerThread(server.app) as url:
        yield url


@pytest.mark.slow
def test_a_trained_drafters_chains_answer_as_decode(model, reference, eagle_chain_url):
    for chat, ref in zip(CHATS, reference):
        assert _greedy_chat(eagle_chain_url, chat) == _text(model, ref)
