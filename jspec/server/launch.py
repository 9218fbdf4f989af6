"""``python -m jspec serve``: load a model (and drafter) as ``generate`` does, build the engine, compile every
program it will run, then serve HTTP with uvicorn until SIGINT / SIGTERM (running requests then drain for up to
--drain-s seconds, the rest are cancelled). ``build_server`` and ``ServerThread`` put the same server together
in a process that already holds a model (the tests, a benchmark)."""

from __future__ import annotations

import argparse
import dataclasses
import socket
import sys
import threading
import time

from jspec import validate as V
from jspec.serve import Engine, freeze_gc_heap
from jspec.server.app import create_app
from jspec.server.config import DEFAULT_MAX_BODY_BYTES, ServerConfig
from jspec.server.metrics import ServerMetrics
from jspec.server.schema import RequestParser
from jspec.server.worker import EngineWorker


@dataclasses.dataclass
class Server:
    app: object
    worker: EngineWorker
    metrics: ServerMetrics
    warm_s: float | None = None


def build_server(target, params, tokenizer, config: ServerConfig, *, drafter=None, draft_params=None, gamma=None,
                 eos_ids=(), adaptive=None, goodput=None, block_verify=False) -> Server:  # fmt: skip
    """The engine (``config``'s rows, cache, logprob / bias / penalty slots) over ``target`` and the drafter,
    its worker and the application; with ``config.warmup`` every program is compiled here."""
    engine = Engine(
        target, params, batch=config.rows, max_len=config.max_len, drafter=drafter, draft_params=draft_params,
        gamma=gamma, eos_ids=tuple(eos_ids), block_verify=block_verify, adaptive=adaptive, bucket=config.bucket,
        seed=config.seed, rounds_per_sync=config.rounds_per_sync, logprobs=config.max_logprobs is not None,
        max_stop_ids=config.max_stop_ids, max_logit_bias=config.max_logit_bias,
        top_logprobs=config.max_logprobs or 0, penalties=config.penalties,
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), goodput=goodput,
    )  # fmt: skip
    metrics = ServerMetrics(engine.config.gamma + 1)
    worker = EngineWorker(engine, config, metrics)
    parser = RequestParser(config, target, drafter, tokenizer, engine.config.eos_ids)
    app = create_app(worker, parser, metrics, lambda i: tokenizer.decode([i]))
    server = Server(app, worker, metrics)
    if config.warmup:
        server.warm_s = worker.warm()
    return server


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving ``app`` on a thread of this process (``with ServerThread(app) as url: ...``), on a free
    loopback port unless one is given."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, drain_s: float = 5.0):
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=drain_s, lifespan="on")  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="jspec-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def _parser() -> argparse.ArgumentParser:
    from jspec.cli import DRAFTERS
    from jspec.loaders import LAYER_LAYOUTS

    ap = argparse.ArgumentParser(prog="python -m jspec serve", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registry name, .gguf file or HF directory")
    ap.add_argument("--served-model-name", default=None, help="the name clients send (default: --model)")
    ap.add_argument("--drafter", default="ngram", choices=DRAFTERS)
    ap.add_argument("--draft-model", default=None, help="--drafter model/draft/layerskip/eagle: as for generate")
    ap.add_argument("--gamma", type=int, default=None, help="K, candidates per round (default 4)")
    ap.add_argument("--ngram-max", type=int, default=None, help="longest suffix n-gram looked up (default 3)")
    ap.add_argument("--ngram-min", type=int, default=None, help="shortest suffix n-gram looked up (default 1)")
    ap.add_argument("--adaptive", action="store_true", help="per row, draft K or nothing, from its acceptance")
    ap.add_argument("--goodput", action="store_true", help="each round, the K that commits most tokens per second")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    d = ServerConfig("-")
    ap.add_argument("--rows", type=int, default=d.rows, help="requests decoded at once (the engine's batch)")
    ap.add_argument("--max-len", type=int, default=d.max_len, help="cache slots per request: prompt + max_tokens - 1")
    ap.add_argument("--max-queue", type=int, default=d.max_queue, help="requests that may wait; one more gets 429")
    ap.add_argument("--max-logprobs", type=int, default=d.max_logprobs, help="alternatives a request may ask for")
    ap.add_argument("--no-logprobs", action="store_true", help="no log-probabilities (the cheapest rounds)")
    ap.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias, help="logit_bias entries per request")
    ap.add_argument("--no-penalties", action="store_true", help="refuse repetition/presence/frequency penalties "
                    "(the engine then keeps no [rows, vocab] token counts)")  # fmt: skip
    ap.add_argument("--rounds-per-sync", type=int, default=d.rounds_per_sync, help="decode rounds per host sync")
    ap.add_argument("--bucket", type=int, default=d.bucket, help="prompt widths are padded to a multiple of it")
    ap.add_argument("--seed", type=int, default=d.seed, help="the engine's seed (requests without a seed)")
    ap.add_argument("--no-warmup", action="store_true", help="compile on first use instead of before serving")
    ap.add_argument("--drain-s", type=float, default=d.drain_s, help="on shutdown, how long requests may finish")
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 400")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--layers", default="auto", choices=LAYER_LAYOUTS, help="as for generate")
    ap.add_argument("--compile-cache", default=None, help="as for generate ('none' to disable)")
    ap.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    ap.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log)")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        server = _build(args)
    except (ValueError, OSError) as e:  # bad flags, a missing checkpoint: a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    frozen = freeze_gc_heap()  # as the benchmark's runner does once warm: no old-generation pauses in requests
    print(f"[jspec serve: {server.worker.config.model} on http://{args.host}:{args.port}, warm-up "
          f"{server.warm_s or 0:.1f} s, {frozen} objects frozen]", file=sys.stderr)  # fmt: skip
    uvicorn.run(server.app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log,
                timeout_graceful_shutdown=args.drain_s, lifespan="on")  # fmt: skip
    return 0


def _build(args) -> Server:
    from jspec.cli import build_drafter
    from jspec.loaders import compile_cache_flag, end_ids, load_model, model_loader, wants_unstacked

    if args.drafter == "none" and (args.gamma is not None or args.adaptive or args.goodput):
        raise ValueError("--gamma, --adaptive and --goodput need a drafter (--drafter none decodes plainly)")
    with V.as_flags([f.name for f in dataclasses.fields(ServerConfig)]):  # "rows must ..." -> "--rows must ..."
        config = _config(args)
    compile_cache_flag(args.compile_cache)
    loaded = load_model(model_loader(), args.model, args.dtype, unstacked=wants_unstacked(args.layers))
    _, params, target, tok = loaded
    if tok is None:
        raise ValueError(f"'{args.model}' has no tokenizer; the server needs one")
    # build_drafter reads generate's tree flags too; the server takes chains and n-gram trees.
    ns = argparse.Namespace(**vars(args), branches=None, tree=None, tree_budget=None, tree_rule=None,
                            dynamic_tree=None)  # fmt: skip
    drafter, dparams = build_drafter(ns, target, loaded)
    return build_server(target, params, tok, config, drafter=drafter, draft_params=dparams, gamma=args.gamma,
                        eos_ids=end_ids(tok), adaptive=args.adaptive or None, goodput=args.goodput or None)  # fmt: skip


def _config(args) -> ServerConfig:
    return ServerConfig(
        args.served_model_name or args.model, rows=args.rows, max_len=args.max_len, max_queue=args.max_queue,
        max_logprobs=None if args.no_logprobs else args.max_logprobs, max_logit_bias=args.max_logit_bias,
        penalties=not args.no_penalties, rounds_per_sync=args.rounds_per_sync, bucket=args.bucket, seed=args.seed,
        warmup=not args.no_warmup, drain_s=args.drain_s, max_body_bytes=args.max_body_bytes,
    )  # fmt: skip
