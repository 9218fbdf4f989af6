"""The OpenAI-compatible server (``jspec.server``), started on a loopback port and driven with the official
``openai`` client: greedy answers are ``jspec.decode``'s, streams add up to the whole answer, stop strings and
max_tokens end answers as vLLM documents, bad requests are 400s naming their field, a full queue is 429, a
client that leaves frees its row, and nothing a client sends stops the others.

Two servers (plain and n-gram speculation) share one engine shape (2 rows, 256 slots, prompts under 64 tokens:
one prefill width), so each compiles its two programs once; the references are one batched ``decode`` call.
The trained drafters' servers (a draft model, LayerSkip self-speculation) and block verification are built
from ``serve``'s own flags over the same model, one server per flag set, started when a test first asks for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the serve extra: pip install -e '.[serve]'")

from jspec.decode import decode  # noqa: E402
from jspec.ngram import NgramDrafter  # noqa: E402
from jspec.serve import Engine  # noqa: E402
from jspec.server import ServerConfig, ServerThread, build_server  # noqa: E402
from jspec.server.launch import build_from_flags, serve_parser  # noqa: E402
from jspec.server.schema import APIError, RequestParser  # noqa: E402

MODEL = "smollm2"
N = 20  # new tokens of the reference answers
CHATS = (
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "What is a prime number?"}],
)


@pytest.fixture(scope="module")
def model(smollm2):
    return smollm2


@pytest.fixture(scope="module")
def reference(model):
    """jspec.decode's greedy answers to CHATS (one batched call: one compile), as token ids."""
    tok = model.tokenizer
    prompts = [tok.encode_chat(c) for c in CHATS]
    out = decode(model.model, model.params, prompts, max_new_tokens=N, eos_ids=tok.eos_ids)
    return [list(t) for t in out.tokens]


def _server(model, drafter=None):
    # rows 2 and a queue of 1: the 429 test fills them with three requests.
    cfg = ServerConfig(MODEL, rows=2, max_len=256, max_queue=1, max_logprobs=3, max_logit_bias=4, warmup=False,
                       max_body_bytes=64 * 1024)  # fmt: skip
    tok = model.tokenizer
    # A fixed K (the default's, chosen each round from measured costs, has its own test: test_serve_default_...).
    gamma = None if drafter is None else 4
    return build_server(model.model, model.params, tok, cfg, drafter=drafter, gamma=gamma, eos_ids=tok.eos_ids)


@pytest.fixture(scope="module")
def urls(model):
    """{"plain": url, "ngram": url}: the two servers, each on a free loopback port for the module."""
    ngram = NgramDrafter(3, 1, vocab_size=model.model.vocab_size)
    with ServerThread(_server(model).app) as plain, ServerThread(_server(model, ngram).app) as spec:
        yield {"plain": plain, "ngram": spec}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _text(model, ids) -> str:
    return model.tokenizer.decode(ids, skip_special_tokens=True)


def _metric(url: str, name: str, labels: str = "") -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    return 0.0


def _wait_for(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("server", ["plain", "ngram"])
def test_greedy_chat_equals_decode_and_streams_add_up(model, reference, urls, server):
    c = _client(urls[server])
    for chat, ref in zip(CHATS, reference):
        r = c.chat.completions.create(model=MODEL, messages=chat, max_tokens=N, temperature=0)
        eos = ref[-1] in model.tokenizer.eos_ids
        assert r.choices[0].message.content == _text(model, ref)
        assert r.choices[0].finish_reason == ("stop" if eos else "length")
        assert r.usage.completion_tokens == len(ref)
        assert r.usage.prompt_tokens == len(model.tokenizer.encode_chat(chat))
        chunks = list(c.chat.completions.create(model=MODEL, messages=chat, max_tokens=N, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))  # fmt: skip
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == _text(model, ref)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref)


@pytest.mark.slow
def test_completions_take_token_ids_and_return_them(model, reference, urls):
    c = _client(urls["ngram"])
    prompt = model.tokenizer.encode_chat(CHATS[0])
    whole = c.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0,
                                 extra_body={"return_token_ids": True})  # fmt: skip
    assert whole.choices[0].text == _text(model, reference[0])
    assert whole.choices[0].model_extra["token_ids"] == reference[0]
    parts = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    # The raw stream: server-sent events ending with OpenAI's [DONE].
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", urls["ngram"] + "/v1/completions", json=body, timeout=60) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


@pytest.mark.slow
def test_stop_strings_and_max_tokens_as_vllm_documents(model, reference, urls):
    c = _client(urls["plain"])
    full = _text(model, reference[0])
    # A stop string from the middle of the reference answer: the text ends right before its first occurrence.
    stop = full.split()[2]
    r = c.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=N, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop
    kept = r.usage.completion_tokens  # up to the token completing the string
    assert stop in _text(model, reference[0][:kept]) and stop not in _text(model, reference[0][: kept - 1])
    streamed = c.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=N, temperature=0, stop=stop,
                                         stream=True)  # fmt: skip
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == r.choices[0].message.content
    for n in (1, 5):
        r = c.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=n, temperature=0)
        assert r.choices[0].message.content == _text(model, reference[0][:n])
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n


@pytest.mark.slow
def test_sampling_options_logprobs_and_seed(urls):
    c = _client(urls["plain"])
    r = c.chat.completions.create(model=MODEL, messages=CHATS[1], max_tokens=6, temperature=0, logprobs=True,
                                  top_logprobs=2)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:  # greedy: each token is its position's most likely one
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob) and e.logprob <= 0
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0.9, top_p=0.95, presence_penalty=0.5,
              seed=7, extra_body={"top_k": 50, "min_p": 0.05, "repetition_penalty": 1.1})  # fmt: skip
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    # logit_bias moves a greedy answer off the token it bans.
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0)
    first = c.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    other = c.completions.create(**kw, logit_bias={str(first.model_extra["token_ids"][0]): -100})
    assert other.choices[0].text != first.text


BAD = [
    ({"model": "gpt-4"}, "model"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 300}, "max_tokens"),  # the prompt + 300 is past the 256 slots
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logprobs": 9}, "logprobs"),  # past --max-logprobs 3
    ({"n": 2}, "n"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens
    ({"echo": True}, "echo"),
    ({"temperature": "hot"}, "temperature"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),  # more than the 4 the engine holds per request
    ({"prompt": list(range(300))}, "prompt"),  # past the context alone
]


@pytest.mark.slow
def test_bad_requests_are_400_naming_the_field(urls):
    c = _client(urls["plain"])
    for change, field in BAD:
        kw = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **change}
        model, prompt = kw.pop("model"), kw.pop("prompt")
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=model, prompt=prompt, extra_body=kw)
        err = e.value.body
        assert err["param"] == field, (change, err)
        assert err["type"] == "invalid_request_error" and err["message"], err
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 300}])
    assert e.value.body["param"] == "messages" and e.value.body["code"] == "context_length_exceeded"


@pytest.mark.slow
def test_malformed_and_oversized_bodies_are_400(urls):
    url = urls["plain"] + "/v1/completions"
    r = httpx.post(url, content=b'{"model": "smollm2", "prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url, json={"model": MODEL, "prompt": "x" * 100_000})  # past max_body_bytes (64 KiB)
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(url, content=json.dumps([1, 2]))
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(urls["plain"] + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


@pytest.mark.slow
def test_models_health_and_metrics(urls):
    c = _client(urls["ngram"])
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert httpx.get(urls["ngram"] + "/health").json() == {"status": "ok"}
    text = httpx.get(urls["ngram"] + "/metrics").text
    for name in (
        "jspec_requests_total",
        "jspec_generation_tokens_total",
        "jspec_time_to_first_token_seconds_bucket",
        "jspec_inter_token_latency_seconds_bucket",
        "jspec_tokens_per_round_bucket",
        "jspec_queue_waiting",
        "jspec_cache_usage",
        'jspec_draft_acceptance{position="0"}',
        'jspec_draft_length_rounds_total{k="4"}',
        "jspec_engine_step_seconds_count",
    ):
        assert name in text, name  # fmt: skip
    assert _metric(urls["ngram"], "jspec_rows") == 2


def _open_stream(url: str, max_tokens: int = 200):
    """A long streamed request (min_tokens holds its EOS back), read up to its first chunk (the role, sent before
    the request is admitted); returns the stream."""
    s = _client(url).chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"min_tokens": max_tokens})  # fmt: skip
    next(iter(s))
    return s


@pytest.mark.slow
def test_a_cancelled_stream_frees_its_row(urls):
    url = urls["plain"]
    cancelled = _metric(url, "jspec_requests_total", '{outcome="cancelled"}')
    s = _open_stream(url)
    _wait_for(lambda: _metric(url, "jspec_rows_running") == 1, "the stream's row")
    s.close()
    _wait_for(lambda: _metric(url, "jspec_rows_running") == 0, "the row freed")
    _wait_for(lambda: _metric(url, "jspec_requests_total", '{outcome="cancelled"}') == cancelled + 1, "the count")


@pytest.mark.slow
def test_full_queue_is_429_and_the_rest_keep_streaming(model, reference, urls):
    url = urls["plain"]
    c = _client(url)
    # Two rows busy and one request waiting fill this server (rows 2, --max-queue 1); the next one is refused.
    busy = [_open_stream(url), _open_stream(url)]
    _wait_for(lambda: _metric(url, "jspec_rows_running") == 2, "both rows busy")  # a stream opens before its prefill
    waiting_done = threading.Event()
    waiting: list[str] = []

    def wait_in_queue():
        r = c.chat.completions.create(model=MODEL, messages=CHATS[1], max_tokens=N, temperature=0)
        waiting.append(r.choices[0].message.content)
        waiting_done.set()

    t = threading.Thread(target=wait_in_queue)
    t.start()
    _wait_for(lambda: _metric(url, "jspec_queue_waiting") == 1, "a waiting request")
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=4)
    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
    # A bad request while the others run: refused alone.
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=4, top_p=7)
    # The streams go on; closing one admits the waiting request, which answers exactly.
    assert next(iter(busy[0])).choices
    busy[0].close()
    assert waiting_done.wait(120)
    t.join()
    assert waiting == [_text(model, reference[1])]
    busy[1].close()
    _wait_for(lambda: _metric(url, "jspec_rows_running") == 0, "every row freed")


# The drafters' servers: _server's engine shape (the same prefill width), and the benchmark's lean rounds (no
# log-probabilities, penalties or logit bias: smaller programs, which compile faster).
SHAPE_FLAGS = ("--model", MODEL, "--rows", "2", "--max-len", "256", "--max-queue", "1", "--no-logprobs",
               "--no-penalties", "--max-logit-bias", "0", "--no-warmup")  # fmt: skip
N_DRAFTED = 10  # tokens compared: several rounds of each drafter (the untrained ones' candidates are mostly rejected)


@pytest.fixture(scope="module")
def draft_dir(model, tmp_path_factory):
    """A 2-layer draft of SmolLM2 (its first two layers, a 4096-token head; untrained, so most candidates are
    rejected: the harder path), saved as ``examples/train_draft.py`` saves one: what ``--drafter draft`` loads."""
    from models import draft as D

    dcfg = D.draft_config(model.config, 2, head_size=4096)
    token_map = D.frequent_token_map(np.zeros(model.config.vocab_size), 4096, [model.tokenizer.eos_id])
    params = D.init_from_target(dcfg, model.params, token_map)
    return D.save_draft(tmp_path_factory.mktemp("draft") / "d", dcfg, params, tokenizer=model.tokenizer)


@pytest.fixture(scope="module")
def flag_url(model, request):
    """flags -> the url of a server built from ``python -m jspec serve``'s flags (and SHAPE_FLAGS) over the
    session's model; each flag set's server is built and started once, when first asked for, and stopped with
    the module. "{draft}" in a flag is the saved draft's directory, "{target}" the target's checkpoint."""
    servers: dict[tuple[str, ...], str] = {}
    with contextlib.ExitStack() as stack:

        def url(*flags: str) -> str:
            if flags not in servers:
                draft = request.getfixturevalue("draft_dir") if "{draft}" in flags else None  # saved when needed
                target = request.getfixturevalue("smollm2_path")
                argv = [*SHAPE_FLAGS, *(f.format(draft=draft, target=target) for f in flags)]
                server = build_from_flags(serve_parser().parse_args(argv), model)
                servers[flags] = stack.enter_context(ServerThread(server.app))
            return servers[flags]

        yield url


SERVED_DRAFTERS = {
    "draft model": ("--drafter", "draft", "--draft-model", "{draft}", "--gamma", "3"),
    # Any checkpoint with the target's tokenizer drafts: the target itself is the one at hand, and its
    # candidates are accepted (the path the untrained drafters' rejections leave untested).
    "model": ("--drafter", "model", "--draft-model", "{target}", "--gamma", "3"),
    "layerskip": ("--drafter", "layerskip", "--draft-model", "exit:8", "--gamma", "2"),
    "ngram block-verify": ("--drafter", "ngram", "--block-verify", "--gamma", "4"),
}


def _greedy_answers(url: str) -> list:
    """Both chats at once (the server's two rows), greedy, N_DRAFTED tokens each, with their token ids."""
    c = _client(url)

    def ask(chat):
        return c.chat.completions.create(model=MODEL, messages=chat, max_tokens=N_DRAFTED, temperature=0,
                                         extra_body={"return_token_ids": True}).choices[0]  # fmt: skip

    with ThreadPoolExecutor(len(CHATS)) as pool:
        return list(pool.map(ask, CHATS))


@pytest.mark.slow
@pytest.mark.measures_costs
def test_serve_default_chooses_k_each_round_and_answers_greedy_as_plain_decode(model, reference, flag_url):
    """``serve --drafter ngram`` without --gamma: the engine measures its cost table (rows 2, 256 slots) and
    chooses each round's K among 0, 1, 2 and 4; the greedy answers over HTTP are plain decode's, and /metrics
    counts the rounds at each K it may choose."""
    url = flag_url("--drafter", "ngram")
    answers = _greedy_answers(url)
    assert [a.model_extra["token_ids"] for a in answers] == [ref[:N_DRAFTED] for ref in reference]
    name = "jspec_draft_length_rounds_total"
    lines = [line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith(name + "{")]
    rounds = {int(line.split('"')[1]): float(line.split()[-1]) for line in lines}
    assert sorted(rounds) == [0, 1, 2, 4] and sum(rounds.values()) > 0, rounds  # the set it chooses from


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SERVED_DRAFTERS))
def test_served_drafters_answer_greedy_as_plain_decode(model, reference, flag_url, name):
    """A small draft model (``--drafter draft``), a checkpoint as draft model (``--drafter model``), LayerSkip
    self-speculation (``--drafter layerskip --draft-model exit:8``: the target's first 8 layers and its head)
    and block verification (``--block-verify``): the greedy answers over HTTP, both chats in the two rows at
    once, are plain ``jspec.decode``'s token for token, and the drafter did propose (and, drafting with the
    target itself, had its candidates accepted)."""
    url = flag_url(*SERVED_DRAFTERS[name])
    answers = _greedy_answers(url)
    want = [ref[:N_DRAFTED] for ref in reference]  # greedy: the first tokens of decode's longer answers
    assert [a.model_extra["token_ids"] for a in answers] == want
    assert [a.message.content for a in answers] == [_text(model, ids) for ids in want]
    # read when the server went idle (the answers are back): the counters are whole
    assert _metric(url, "jspec_draft_proposed_total", '{position="0"}') > 0
    if name == "model":
        assert _metric(url, "jspec_draft_accepted_total", '{position="2"}') > 0


@pytest.mark.slow
def test_block_verify_server_samples_as_decode_does(model, flag_url):
    """Sampled with a seed, the ``--block-verify`` server's tokens are ``jspec.decode``'s with block_verify=True
    and the same seed (a request follows its own seed whatever its row: test_row_seeds), so its sampled rounds
    run block verification. The prompt repeats itself, so the n-gram drafter proposes."""
    tok = model.tokenizer
    prompt = tok.encode("one two three four, one two three four, one two three four, one two")
    kw = dict(max_new_tokens=12, temperature=0.8, eos_ids=tok.eos_ids, max_len=256)
    ngram = NgramDrafter(3, 1, vocab_size=model.model.vocab_size)
    want = decode(model.model, model.params, [prompt], drafter=ngram, gamma=4, block_verify=True, seed=[5], **kw)
    assert want.stats["proposed"] > 0
    url = flag_url(*SERVED_DRAFTERS["ngram block-verify"])
    r = _client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.8, seed=5,
                                        extra_body={"return_token_ids": True})  # fmt: skip
    assert r.choices[0].model_extra["token_ids"] == list(want.tokens[0])


class _CharTokenizer:
    """A stand-in tokenizer for the toy model's 3-token vocabulary: a character's code modulo it."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [ord(ch) % self.vocab for ch in text]

    def encode_chat(self, messages) -> list[int]:
        return self.encode("".join(m["role"] + ": " + m["content"] + "\n" for m in messages))


@pytest.mark.fast
def test_parser_names_each_bad_field_without_a_model():
    from test_decode_core import TARGET

    cfg = ServerConfig(MODEL, rows=2, max_len=256, max_logprobs=3, max_logit_bias=4)
    parser = RequestParser(cfg, TARGET, None, _CharTokenizer(TARGET.vocab_size), eos_ids=(0,))
    for change, field in BAD:
        with pytest.raises(APIError) as e:
            parser.completion({"model": MODEL, "prompt": "Hello", "max_tokens": 4, **change})
        assert (e.value.status, e.value.param) == (400, field), (change, e.value.message)
    ok = parser.chat({"model": MODEL, "messages": CHATS[1], "top_k": -1, "logprobs": True, "top_logprobs": 3})
    assert ok.top_k == 0 and ok.logprobs == 3 and ok.chat  # vLLM's -1: no top-k
    assert ok.max_tokens == 256 - len(ok.prompt) + 1  # a chat's default: what the context leaves
    assert parser.completion({"model": MODEL, "prompt": [1, 2]}).max_tokens == 16  # OpenAI's default


@pytest.mark.fast
def test_a_fresh_engine_state_is_strongly_typed():
    """A weakly typed leaf in a fresh engine's state made its first add() and step() compile each program a
    second time (the state a step returns is strongly typed)."""
    import jax
    from test_decode_core import TARGET, TARGET_PARAMS

    eng = Engine(TARGET, TARGET_PARAMS, batch=2, max_len=16)
    assert not [x for x in jax.tree.leaves(eng.state) if getattr(x, "weak_type", False)]


@pytest.mark.slow
def test_http_runner_records_the_servers_answers(model, reference, urls):
    """The benchmark's HTTP mode: Poisson arrivals sent as token-id prompts, each stream's events timed as
    emissions; the tokens are decode's, and the decode statistics come from the server's counters."""
    from jspec.bench import http_runner
    from jspec.bench.runspec import Job, Load, Spec

    tok = model.tokenizer
    jobs = [Job(f"chat-{i}", "chat", tuple(tok.encode_chat(c))) for i, c in enumerate(CHATS)]
    jobs.append(Job("too-long", "chat", tuple(range(300))))  # refused by the server (400): an error, the run goes on
    for server in ("plain", "ngram"):
        r = http_runner.run(urls[server], MODEL, Spec(server), Load.open(50.0, 2), jobs, max_new_tokens=N)
        assert [rec.tokens for rec in r.records[:2]] == reference
        assert all(rec.ok and rec.emissions and rec.ttft > 0 for rec in r.records[:2])
        assert sum(n for _, n in r.records[0].emissions) == len(reference[0])
        bad = r.records[2]
        assert not bad.ok and "HTTP 400" in bad.error and r.summary["errors"] == 1
        stats = r.decode_stats
        assert stats["decode_tokens"] == sum(len(t) - 1 for t in reference)
        assert stats["draft_lengths"] == ([0] if server == "plain" else [4])
        assert sum(stats["k_rounds"]) == stats["engine_rounds"] > 0  # read when the server went idle: whole
        if server == "plain":
            assert stats["tokens_per_round"] == 1.0 and stats["proposed_at"] == []
        else:
            assert stats["tokens_per_round"] >= 1.0 and sum(stats["proposed_at"]) > 0


def _toy_worker(drain_s: float):
    """An engine worker over the toy model (compiles in seconds): 1 row, no queue."""
    from test_decode_core import TARGET, TARGET_PARAMS

    from jspec.server.metrics import ServerMetrics
    from jspec.server.worker import EngineWorker

    cfg = ServerConfig("toy", rows=1, max_len=64, max_queue=0, max_logprobs=None, warmup=False, drain_s=drain_s)

    def detokenize(ids):  # slow, so that a request of 40 tokens still runs when the test shuts the worker down
        time.sleep(0.02)
        return "".join("abc"[i] for i in ids)

    eng = Engine(TARGET, TARGET_PARAMS, batch=1, max_len=64, detokenize=detokenize)
    return EngineWorker(eng, cfg, ServerMetrics(1))


@pytest.mark.fast
@pytest.mark.parametrize("drain_s", [0.0, 60.0])
def test_shutdown_drains_or_cancels(drain_s):
    from jspec.server.schema import GenerationRequest
    from jspec.server.worker import Delta, Done, Failed, QueueFull, ShuttingDown, Ticket

    worker = _toy_worker(drain_s)
    events, got_one = [], threading.Event()

    def emit(ev):
        events.append(ev)
        got_one.set()

    req = GenerationRequest(False, (0, 1, 2), max_tokens=40, temperature=0.0)
    worker.start()
    worker.submit(Ticket(req, emit))
    with pytest.raises(QueueFull):  # its one row is taken (or about to be) and the queue holds none
        worker.submit(Ticket(req, emit))
    assert got_one.wait(60)
    worker.shutdown()
    with pytest.raises(ShuttingDown):
        worker.submit(Ticket(req, emit))
    assert all(isinstance(e, Delta) for e in events[:-1])
    if drain_s:  # drained: the request ran to its budget
        assert isinstance(events[-1], Done) and events[-1].completion_tokens == 40
        assert sum(len(e.tokens) for e in events[:-1]) == 40
    else:  # cancelled: its client is told
        assert isinstance(events[-1], Failed) and "stopped" in events[-1].message
    assert worker.load() == (0, 0, 0)


NEED_DRAFTER = "--gamma, --adaptive, --[no-]goodput and --block-verify need a drafter"


@pytest.mark.fast
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rows", "0"], "--rows must be an int >= 1"),
        (["--max-logprobs", "50"], "--max-logprobs must be an int in [0, 20]"),
        (["--max-queue", "-1"], "--max-queue must be an int >= 0"),
        (["--drafter", "none", "--gamma", "4"], NEED_DRAFTER),
        (["--drafter", "none", "--block-verify"], NEED_DRAFTER),
        (["--drafter", "none", "--no-goodput"], NEED_DRAFTER),
        (["--drafter", "ngram-tree", "--block-verify"], "--block-verify verifies a chain's candidates as one block"),
        (["--drafter", "eagle", "--tree", "4,1", "--block-verify"], "which --tree excludes"),
        (["--drafter", "layerskip", "--dynamic-tree", "4,3,8", "--block-verify"], "which --dynamic-tree excludes"),
        (["--drafter", "ngram", "--tree", "4,1"], "--tree does not apply to --drafter ngram"),
        (["--drafter", "eagle", "--tree", "4,1", "--gamma", "2"], "--gamma does not apply with --tree"),
        (["--drafter", "ngram", "--goodput", "--gamma", "4"], "which --gamma (a fixed K) excludes"),
        (["--drafter", "eagle", "--tree-budget", "3"], "--tree-budget applies to --tree"),
        (["--drafter", "eagle", "--dynamic-tree", "4,3"], "--dynamic-tree wants TOP_K,DEPTH,BUDGET"),
        (["--drafter", "eagle", "--tree", "4,1", "--adaptive"], "--adaptive drafts a chain's K or nothing"),
    ],
)
def test_serve_command_refuses_bad_flags_before_loading(argv, message, capsys):
    from jspec.cli import main

    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.fast
def test_every_serve_flag_is_documented():
    """docs/serving.md's flag table names every flag of ``python -m jspec serve``."""
    import pathlib

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "serving.md").read_text()
    flags = [o for a in serve_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert "--block-verify" in flags
    assert [f for f in flags if f"`{f}`" not in doc] == []


@pytest.mark.fast
@pytest.mark.parametrize("argv, message", [(["--rates", "0"], "--rates"), (["--rows", "0"], "--rows 0")])
def test_http_benchmark_refuses_bad_flags_before_loading(argv, message, capsys, tmp_path):
    from jspec.bench.http_bench import main

    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(tmp_path / "out"), "--record", str(tmp_path / "r.json")])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.fast
def test_http_benchmark_drafters_are_the_grids_spellings():
    from types import SimpleNamespace

    from jspec.bench.http_bench import http_specs, parse_drafters, server_drafter_args

    assert [c.name for c in parse_drafters(None, None, False)] == ["ngram K=4"]
    assert [c.name for c in parse_drafters(None, 3, False)] == ["ngram K=3"]
    choices = parse_drafters("ngram:2, ngram:goodput", None, False)
    assert [c.name for c in choices] == ["ngram K=2", "ngram goodput K<=4"]
    target = SimpleNamespace(model=SimpleNamespace(vocab_size=50))
    plain, fixed, goodput = http_specs(target, choices)
    assert [s.label for s in (plain, fixed, goodput)] == ["plain", "ngram K=2", "ngram goodput K<=4"]
    assert (goodput.goodput, goodput.engine_gamma, fixed.engine_gamma) == (True, None, 2)
    ngram = ["--drafter", "ngram", "--ngram-max", "3", "--ngram-min", "1"]
    assert server_drafter_args(plain) == ["--drafter", "none"]
    assert server_drafter_args(fixed) == [*ngram, "--gamma", "2"]
    assert server_drafter_args(goodput) == [*ngram, "--goodput"]
    (adaptive,) = http_specs(target, parse_drafters("ngram", None, True), adaptive=True)[1:]
    assert server_drafter_args(adaptive) == [*ngram, "--gamma", "4", "--adaptive"]


@pytest.mark.fast
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--drafters", "eagle:2"], "this benchmark runs the n-gram drafter"),
        (["--drafters", "ngram:x"], "K must be an integer >= 1"),
        (["--drafters", "ngram,ngram:4"], "ngram K=4 is given twice"),
        (["--drafters", "ngram:goodput", "--adaptive"], "--adaptive with 'ngram:goodput'"),
        (["--drafters", "ngram:2", "--gamma", "3"], "--gamma and --drafters both set K"),
    ],
)
def test_http_benchmark_refuses_bad_drafters_before_loading(argv, message, capsys, tmp_path):
    from jspec.bench.http_bench import main

    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(tmp_path / "out"), "--record", str(tmp_path / "r.json")])
    assert e.value.code == 2 and message in capsys.readouterr().err


def _fake_run(spec, transport: str, n: int, ms: float):
    """A run's result as the HTTP and in-process runners return it, with made-up numbers (no model)."""
    from jspec.bench.metrics import RequestRecord
    from jspec.bench.runspec import Load, RunResult, Sampling

    recs = [RequestRecord(f"r{i}", "chat", 4, 0.0) for i in range(2)]
    for r in recs:
        r.tokens, r.stop_reason, r.finished = [1, 2, 3], "max_new_tokens", 1.0
    dist = {"median": ms, "p95": 2 * ms}
    summary = {"request_set": "x", "submitted": 2, "finished": 2, "errors": 0, "timeouts": 0, "not_run": 0,
               "output_tokens": 6, "wall_s": 1.0 + n, "output_tokens_per_s": 6 / (1.0 + n),
               "decode_tokens_per_s": 10.0 + n, "finished_requests_per_s": 2 / (1.0 + n), "ttft_ms": dist,
               "itl_ms": dist, "itl_nonzero_ms": dist, "tpot_ms": dist}  # fmt: skip
    return RunResult(spec, Load.open(1.0, 2), Sampling(), 3, recs, summary, {"tokens_per_round": 1.0}, {}, {},
                     extra={"transport": transport})  # fmt: skip


@pytest.mark.fast
def test_http_benchmark_passes_alternate_and_each_is_recorded(tmp_path):
    """Three passes over plain and a goodput configuration, each over HTTP and in-process, with a fake runner:
    the pairs swap places and their members swap order from pass to pass, every pass lands in the record (its
    seed record too), and the comparisons give each field's median over the passes."""
    from types import SimpleNamespace

    from jspec.bench import record, serving_record
    from jspec.bench.http_bench import HTTP, IN_PROCESS, comparisons, http_specs, parse_drafters, run_passes

    target = SimpleNamespace(model=SimpleNamespace(vocab_size=50))
    plain, goodput = http_specs(target, parse_drafters("ngram:goodput", None, False))
    groups = [[(s, HTTP), (s, IN_PROCESS)] for s in (plain, goodput)]
    order: list[str] = []

    def fake(spec, transport):
        order.append(f"{spec.label}/{transport}")
        return _fake_run(spec, transport, len(order), ms=float(len(order)))

    first = run_passes(groups, 3, fake, log=lambda *_: None)
    p, g = "plain", "ngram goodput K<=4"
    assert order == [
        f"{p}/http", f"{p}/in-process", f"{g}/http", f"{g}/in-process",
        f"{g}/in-process", f"{g}/http", f"{p}/in-process", f"{p}/http",
        f"{p}/http", f"{p}/in-process", f"{g}/http", f"{g}/in-process",
    ]  # fmt: skip
    assert len(first) == 4
    for (label, transport), r in first.items():
        passes = r.extra["passes"]
        assert [x["pass"] for x in passes] == [0, 1, 2]
        assert [x["position"] for x in passes] == [order.index(f"{label}/{transport}", 4 * i) - 4 * i for i in range(3)]
        assert all(x["seed_record"]["itl_ms_p95"] > 0 and x["same_tokens_as_first_pass"] for x in passes)
    comp = comparisons(first)
    assert comp["median_over_passes"][f"{g} (http)"]["passes"] == 3
    assert comp["median_over_passes"][f"{g} (http)"]["itl_ms_p50"] == 6.0  # passes at ms 3, 6, 11
    assert set(comp["goals"]) == set(comp["speculative_vs_plain_http"]) == {g}
    assert set(comp["http_overhead"]) == {p, g}
    for r in first.values():  # the runner labels a run with its transport
        r.spec = dataclasses.replace(r.spec, label=f"{r.spec.label} ({r.extra['transport']})")
    rec = record.Record("serving-http", "test", {}, str(tmp_path / "r.json"))
    serving_record.add_runs(rec, list(first.values()))
    assert [len(p["runs"]) for p in rec.data["passes"]] == [4, 4, 4]


@pytest.mark.fast
@pytest.mark.measures_costs
def test_the_in_process_runner_serves_a_goodput_spec(tmp_path, monkeypatch):
    """The benchmark's in-process side of ``ngram:goodput``: the engine chooses K each round from a measured cost
    table (goodput=True, K up to 4) and its greedy tokens are plain decoding's (toy model)."""
    from test_decode_core import TARGET, TARGET_PARAMS

    from jspec.bench import runner
    from jspec.bench.runspec import Job, Load, Spec

    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))  # the measured table goes here, not to ~/.cache
    jobs = [Job("a", "w", (0, 1, 2, 1, 0, 1, 2)), Job("b", "w", (2, 2, 1))]
    ngram = NgramDrafter(vocab_size=TARGET.vocab_size)
    kw = dict(max_new_tokens=12, max_len=128, bucket=16, warmup=False, freeze_gc=False)  # the profile needs ~80 slots
    plain = runner.run(TARGET, TARGET_PARAMS, Spec("plain"), Load.closed(2), jobs, **kw)
    spec = Spec("ngram goodput K<=4", ngram, goodput=True)
    r = runner.run(TARGET, TARGET_PARAMS, spec, Load.closed(2), jobs, **kw)
    assert r.tokens_by_id() == plain.tokens_by_id() and len(r.tokens_by_id()) == 2
    assert r.engine["draft_lengths"] == [0, 1, 2, 4] and sum(r.engine["k_rounds"]) > 0
    assert r.spec.describe()["goodput"] is True
    with pytest.raises(ValueError, match="goodput .* needs no adaptive policy"):
        Spec("x", ngram, goodput=True, adaptive=True)
