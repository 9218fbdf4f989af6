"""``python -m jspec serve``: load a model (and drafter) as ``generate`` does, build the engine, compile every
program it will run, then serve HTTP with uvicorn until SIGINT / SIGTERM (running requests then drain for up to
--drain-s seconds, the rest are cancelled). ``build_server`` and ``ServerThread`` put the same server together
in a process that already holds a model (the tests, a benchmark); ``build_from_flags`` builds it from the
command's own flags (``serve_parser``) over such a model."""

from __future__ import annotations

import argparse
import dataclasses
import signal
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


def serve_parser() -> argparse.ArgumentParser:
    from jspec.cli import DRAFTERS, GOODPUT_HELP
    from jspec.loaders import LAYER_LAYOUTS

    ap = argparse.ArgumentParser(prog="python -m jspec serve", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registry name, .gguf file or HF directory")
    ap.add_argument("--served-model-name", default=None, help="the name clients send (default: --model)")
    ap.add_argument("--drafter", default="ngram", choices=DRAFTERS)
    ap.add_argument("--draft-model", default=None, help="--drafter model/draft/layerskip/eagle: as for generate")
    ap.add_argument(
        "--gamma",
        type=int,
        default=None,
        help="K, every round (default: up to 4, chosen each round); ngram-tree: its depth",
    )
    ap.add_argument("--tree", default=None, help="static tree of a trained drafter, e.g. 4,1 (as for generate)")
    ap.add_argument("--tree-budget", type=int, default=None, help="keep the first N nodes of --tree")
    ap.add_argument("--tree-rule", default=None, choices=("deterministic", "iid", "without-replacement"),
                    help="how --tree's children are drawn (default deterministic)")  # fmt: skip
    ap.add_argument("--dynamic-tree", default=None, help="EAGLE-2 style tree of a trained drafter: TOP_K,DEPTH,BUDGET")
    ap.add_argument("--branches", type=int, default=None, help="continuations of --drafter ngram-tree (default 3)")
    ap.add_argument("--ngram-max", type=int, default=None, help="longest suffix n-gram looked up (default 3)")
    ap.add_argument("--ngram-min", type=int, default=None, help="shortest suffix n-gram looked up (default 1)")
    ap.add_argument("--adaptive", action="store_true", help="per row, draft K or nothing, from its acceptance")
    ap.add_argument("--goodput", action=argparse.BooleanOptionalAction, default=None, help=GOODPUT_HELP)
    ap.add_argument("--block-verify", action="store_true", help="block verification of chains (Sun et al.)")
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
    args = serve_parser().parse_args(argv)
    try:
        server = _build(args)
    except (ValueError, OSError) as e:  # bad flags, a missing checkpoint: a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    frozen = freeze_gc_heap()  # as the benchmark's runner does once warm: no old-generation pauses in requests
    print(f"[jspec serve: {server.worker.config.model} on http://{args.host}:{args.port}, warm-up "
          f"{server.warm_s or 0:.1f} s, {frozen} objects frozen]", file=sys.stderr)  # fmt: skip
    http = uvicorn.Server(uvicorn.Config(server.app, host=args.host, port=args.port, log_level=args.log_level,
                                         access_log=args.access_log, timeout_graceful_shutdown=args.drain_s,
                                         lifespan="on"))  # fmt: skip

    def stop(sig, frame) -> None:  # a signal asks for a clean stop: drain, then exit 0
        http.should_exit = True

    # uvicorn handles SIGINT / SIGTERM while it serves, then re-raises the signal it caught through the handlers
    # it found: with the default ones a SIGTERM would end the process by the signal (exit -15) after a clean
    # shutdown. These handlers make that a stop (and one arriving before uvicorn listens stops it at startup).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    http.run()
    if not http.started:  # it could not listen (the port is taken, ...): uvicorn logged why
        print(f"error: the server did not start on http://{args.host}:{args.port}", file=sys.stderr)
        return 1
    return 0


def check_drafter_flags(args) -> None:
    """Refuse, before any model loads, drafter flags that would be ignored or that exclude each other (the
    checks ``generate`` runs on the flags the server shares with it)."""
    from jspec.cli import _FLAG_DRAFTERS, _dynamic_tree_args, check_chain_flags, tree_flag

    if args.drafter == "none" and (
        args.gamma is not None or args.adaptive or args.goodput is not None or args.block_verify
    ):
        raise ValueError(
            "--gamma, --adaptive, --[no-]goodput and --block-verify need a drafter (--drafter none decodes plainly)"
        )
    for name, drafters in _FLAG_DRAFTERS.items():
        if getattr(args, name) is not None and args.drafter not in drafters:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} does not apply to --drafter {args.drafter} (read by: {', '.join(drafters)})")
    if args.tree is not None and args.dynamic_tree is not None:
        raise ValueError("--tree and --dynamic-tree are exclusive")
    for name in ("tree_budget", "tree_rule"):
        if getattr(args, name) is not None and args.tree is None:
            raise ValueError(f"--{name.replace('_', '-')} applies to --tree")
    tree = tree_flag(args)
    if args.goodput and (args.gamma is not None or args.adaptive):
        flag = "--gamma (a fixed K)" if args.gamma is not None else "--adaptive"
        raise ValueError(f"--goodput chooses K each round, which {flag} excludes")
    check_chain_flags(args, tree)
    if args.gamma is not None and args.gamma < 1:
        raise ValueError(f"--gamma {args.gamma}: a drafter drafts K >= 1 tokens a round (--drafter none for plain)")
    if args.gamma is not None and (args.tree or args.dynamic_tree):
        raise ValueError(f"--gamma does not apply with {tree}: a tree drafts to its depth, which its shape sets")
    if args.tree is not None and not all(p.strip().isdigit() for p in args.tree.split(",")):
        raise ValueError(f"--tree wants comma-separated branching factors (e.g. 4,1), got '{args.tree}'")
    if args.dynamic_tree is not None:
        _dynamic_tree_args(args)  # its format


def _build(args) -> Server:
    from jspec.loaders import compile_cache_flag, load_model, model_loader, wants_unstacked

    config = checked_config(args)
    compile_cache_flag(args.compile_cache)
    loaded = load_model(model_loader(), args.model, args.dtype, unstacked=wants_unstacked(args.layers))
    return build_from_flags(args, loaded, config)


def checked_config(args) -> ServerConfig:
    """The drafter flags checked (``check_drafter_flags``) and the ServerConfig of the other flags, whose
    messages name them as flags ("--rows must ..."): everything ``serve`` checks before a model loads."""
    check_drafter_flags(args)
    with V.as_flags([f.name for f in dataclasses.fields(ServerConfig)]):  # "rows must ..." -> "--rows must ..."
        return _config(args)


def build_from_flags(args, loaded, config: ServerConfig | None = None) -> Server:
    """The server ``serve``'s flags (parsed by its parser) describe, over a model already loaded: ``loaded`` is
    (config, params, model, tokenizer) as the model loaders return it. The drafter is built from the flags as
    ``generate`` builds it (``jspec.cli.build_drafter``); ``config`` defaults to ``checked_config(args)``."""
    from jspec.cli import build_drafter
    from jspec.loaders import end_ids

    config = checked_config(args) if config is None else config
    _, params, target, tok = loaded
    if tok is None:
        raise ValueError(f"'{args.model}' has no tokenizer; the server needs one")
    drafter, dparams = build_drafter(args, target, loaded)  # chains and trees, as generate builds them
    return build_server(target, params, tok, config, drafter=drafter, draft_params=dparams, gamma=args.gamma,
                        eos_ids=end_ids(tok), adaptive=args.adaptive or None, goodput=args.goodput,
                        block_verify=args.block_verify)  # fmt: skip


def _config(args) -> ServerConfig:
    return ServerConfig(
        args.served_model_name or args.model, rows=args.rows, max_len=args.max_len, max_queue=args.max_queue,
        max_logprobs=None if args.no_logprobs else args.max_logprobs, max_logit_bias=args.max_logit_bias,
        penalties=not args.no_penalties, rounds_per_sync=args.rounds_per_sync, bucket=args.bucket, seed=args.seed,
        warmup=not args.no_warmup, drain_s=args.drain_s, max_body_bytes=args.max_body_bytes,
    )  # fmt: skip
