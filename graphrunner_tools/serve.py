"""``graphrunner serve``: transformers' own OpenAI-compatible server, its continuous-batching steps replayed from graphs.

What is transformers' and what is ours. The HTTP app, its routes and
handlers (chat completions, completions, responses, streaming, the OpenAI
schemas, request validation, cancel on disconnect), the model's process and
its continuous-batching manager are ``transformers serve --continuous-batching``'s,
used as they are, through their public entry points (:mod:`transformers.cli.serving`:
``ModelManager``, ``ModelLoader``, ``GenerationState``, ``build_server`` and its handlers,
``EngineClient.submit``). graphrunner adds, and replaces nothing:

- the model loader (:class:`graphrunner_tools.serve_engine.GraphModelLoader`, which runs in the model's
  process) hands transformers' engine the model with an ``init_continuous_batching`` of its own
  (:class:`~graphrunner_tools.serve_engine.ServedModel`): the engine's manager is made by
  :func:`graphrunner.hf.init_continuous_batching` with ``autocapture=True``: graphs are captured
  from the model's load on, keys from a ladder, re-planned from the steps served
  (``docs/serving.md``). The model is loaded, and its engine made, before the HTTP server listens
  (transformers' ``ModelManager(force_model=...)``); with a graph backend that load also waits
  (``--capture-first``, the default; ``--capture-in-background`` opts out; on ``--tp`` ranks every rank's
  loop runs meanwhile, granting the keys) until every key of the ladder is captured
  (:func:`~graphrunner_tools.serve_engine.capture_before_serving`), so ``/health`` answers only then
  and every step replays from the first request. ``--eager`` serves without graphs (transformers' own
  engine, the same command and flags otherwise);
- in front of the app, :class:`~graphrunner_tools.serve_admission.FrontDoor`: the API key
  (``--api-key``), the admin routes closed (``--admin`` opens them), a bound on the requests in flight
  (429 beyond ``--max-concurrent-requests``), every parameter honoured or refused, malformed messages
  and requests longer than the context or the cache refused (400 with an OpenAI error object naming the
  field), and ``data: [DONE]`` at the end of a stream;
- sampling per request: each request's temperature, top-k, top-p and a generator of its own seeded from
  its ``seed`` (the front door spells them out, :func:`~graphrunner_tools.serve_admission.admitted_body`;
  the engine draws each row with them, :class:`~graphrunner_tools.serve_engine.ServedManager` and
  :func:`graphrunner.hf.model_runner.sample_per_request`), on graphs and ``--eager`` alike;
- ``GET /metrics``: Prometheus text (``prometheus_client``) of the graphs, the
  engine (every rank's figures under ``--tp``: ``graphrunner_rank_*{rank}``) and the HTTP requests (:func:`~graphrunner_tools.serve_engine.engine_metrics` runs in the model's
  process through ``EngineClient.submit``; read once at the start, so a transformers whose engine
  it cannot read fails the start);
- a step that raises fails only its own requests (gr.hf's ``autocapture``: a 500 naming the error) and the
  engine serves on; if the engine dies all the same, the server exits 1 within seconds, naming the cause
  (``docs/serving.md``, "When a step fails");
- with no model on the command line, a tiny built-in model
  (:func:`graphrunner_tools.models.tiny_chat.tiny_model_dir`), so the server runs on a fresh
  machine with no download.

Tested with transformers 5.25 (:data:`graphrunner.hf.decode.VERIFIED_TRANSFORMERS_MAJOR`); the
transformers internals it reads are listed in docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
from typing import Any

__all__ = ["add_serve_subparser", "build_app", "serve"]

logger = logging.getLogger("graphrunner")

#: ``--capture-share``'s default: a capture's keys take at most this share of the time while requests are served.
CAPTURE_SHARE = 0.1

#: transformers serve's continuous-batching options, under its names.
_CB_OPTIONS = ("cb_block_size", "cb_num_blocks", "cb_max_batch_tokens", "cb_max_memory_percent", "cb_max_requests")
#: ... and the ContinuousBatchingConfig field of each that is named otherwise.
_CB_NAMES = {"cb_block_size": "page_size", "cb_max_requests": "max_requests_per_batch"}


#: ``/metrics``' one-value families: (kind, name, key of :func:`~graphrunner_tools.serve_engine.engine_metrics`, help).
_SCALARS = (
    ("counter", "graphrunner_real_tokens", "real_tokens", "query tokens of replayed steps"),
    ("counter", "graphrunner_padded_tokens", "padded_tokens", "padding query tokens the graphs computed"),
    ("counter", "graphrunner_real_keys", "real_keys", "keys read by replayed steps"),
    ("counter", "graphrunner_padded_keys", "padded_keys", "padding keys the graphs computed"),
    ("counter", "graphrunner_replans", "replans", "times the keys were re-planned from the steps served"),
    ("counter", "graphrunner_failed_steps", "failed_steps", "steps that raised: their requests failed (a 500)"),
    ("gauge", "graphrunner_graphs_enabled", "graphs_on", "1 when the steps are served from graphs"),
    ("gauge", "graphrunner_graphs_planned", "graphs_planned", "keys (graphs) planned"),
    ("gauge", "graphrunner_graphs_captured", "graphs_captured", "graphs captured and replaying"),
    ("gauge", "graphrunner_ready", "ready", "1 when every planned graph is captured: the server runs at full speed"),
    ("gauge", "graphrunner_capture_seconds", "capture_seconds", "seconds the finished captures took"),
    ("gauge", "graphrunner_requests_active", "requests_active", "requests the engine is generating"),
    ("gauge", "graphrunner_requests_waiting", "requests_waiting", "requests waiting for the engine"),
    ("gauge", "graphrunner_kv_cache_blocks", "cache_blocks", "blocks of the paged KV cache"),
    ("gauge", "graphrunner_kv_cache_free_blocks", "cache_free_blocks", "free blocks of the paged KV cache"),
    ("gauge", "graphrunner_kv_cache_held_blocks", "cache_held_blocks", "blocks running requests hold"),
    (
        "gauge",
        "graphrunner_kv_cache_cached_blocks",
        "cache_cached_blocks",
        "blocks the prefix cache keeps for a later prompt (reclaimable)",
    ),
)


#: ``/metrics``' per-rank families (label ``rank``; ``--tp N``: every rank's, a follower's a second old at most).
_RANK_SCALARS = (
    ("gauge", "graphrunner_rank_graphs_captured", "graphs_captured", "graphs captured and replaying on each rank"),
    ("gauge", "graphrunner_rank_capture_seconds", "capture_seconds", "seconds each rank's finished captures took"),
    (
        "counter",
        "graphrunner_rank_collective_wait_seconds",
        "collective_seconds",
        "seconds each rank's steps waited in collectives with the other ranks (the graphs' agreement per step, "
        "the sampled ids' broadcast)",
    ),
    (
        "counter",
        "graphrunner_rank_synced_steps",
        "synced_steps",
        "steps whose sampled ids each rank took from the driver (--tp: every rank runs the same steps)",
    ),
)


#: ``/metrics``' families of the front door (:class:`~graphrunner_tools.serve_admission.FrontDoor`).
_FRONT = (
    (
        "gauge",
        "graphrunner_http_requests_in_flight",
        "in_flight",
        "generation requests admitted and not answered yet: generating or queued (the queue depth)",
    ),
    ("gauge", "graphrunner_http_requests_max", "max_requests", "most generation requests in flight (429 beyond)"),
    (
        "counter",
        "graphrunner_http_requests_refused_busy",
        "refused_busy",
        "requests refused with 429: too many in flight",
    ),
)


def _metrics_text(
    engine: dict[str, Any], http: dict[tuple, int], model_id: str, front: dict[str, int] | None = None
) -> bytes:
    """The Prometheus exposition of ``engine`` (:func:`engine_metrics`), ``http`` ((path, status) -> count) and
    ``front`` (the front door's ``in_flight``, ``max_requests``, ``refused_busy``)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Snapshot:
        def collect(self) -> Any:
            steps = CounterMetricFamily(
                "graphrunner_steps", "continuous-batching steps served, by path", labels=["model", "path"]
            )
            steps.add_metric([model_id, "replayed"], engine.get("replayed", 0))
            steps.add_metric([model_id, "eager"], engine.get("eager_steps", 0))
            yield steps
            fb = CounterMetricFamily(
                "graphrunner_fallbacks",
                "calls the graphs did not serve, by reason (over_max_bucket: no key covers the step; not captured yet)",
                labels=["model", "reason"],
            )
            for reason, n in sorted(engine.get("fallbacks", {}).items()):
                fb.add_metric([model_id, str(reason)], n)
            yield fb
            for kind, name, key, doc in _SCALARS:
                family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=["model"])
                family.add_metric([model_id], float(engine.get(key, 0)))
                yield family
            ranks = sorted(engine.get("ranks", {}).items(), key=lambda kv: int(kv[0]))
            rank_steps = CounterMetricFamily(
                "graphrunner_rank_steps", "steps served on each rank, by path", labels=["model", "rank", "path"]
            )
            for rank, figures in ranks:
                rank_steps.add_metric([model_id, str(rank), "replayed"], float(figures.get("replayed", 0)))
                rank_steps.add_metric([model_id, str(rank), "eager"], float(figures.get("eager_steps", 0)))
            yield rank_steps
            for kind, name, key, doc in _RANK_SCALARS:
                family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                    name, doc, labels=["model", "rank"]
                )
                for rank, figures in ranks:
                    family.add_metric([model_id, str(rank)], float(figures.get(key, 0)))
                yield family
            req = CounterMetricFamily(
                "graphrunner_http_requests", "HTTP requests answered, by path and status", labels=["path", "status"]
            )
            for (path, status), n in sorted(http.items()):
                req.add_metric([path, str(status)], n)
            yield req
            for kind, name, key, doc in _FRONT:
                family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc)
                family.add_metric([], float((front or {}).get(key, 0)))
                yield family

    registry = CollectorRegistry()
    registry.register(Snapshot())
    return generate_latest(registry)


def build_app(
    model_manager: Any,
    generation_state: Any,
    model_id: str,
    *,
    api_key: str | None = None,
    admin: bool = False,
    max_requests: int = 256,
) -> Any:
    """transformers serve's FastAPI app (its public ``build_server`` with its handlers, as ``Serve.run``
    builds them, no CORS, no chat template defaults) for ``model_manager`` (a ``ModelManager`` serving
    ``model_id``), plus :class:`~graphrunner_tools.serve_admission.FrontDoor` in front (``api_key``,
    ``admin``, ``max_requests``: the request checks, docs/serving.md) and ``GET /metrics``. Its start reads
    the engine's state once (:func:`~graphrunner_tools.serve_engine.engine_metrics`): a transformers whose
    engine ``/metrics`` cannot read fails the start, naming what is missing."""
    from contextlib import asynccontextmanager

    from fastapi import APIRouter, FastAPI, Response
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler

    from graphrunner_tools.serve_admission import FrontDoor, Limits, response_messages
    from graphrunner_tools.serve_engine import engine_metrics

    chat = ChatCompletionHandler(model_manager=model_manager, generation_state=generation_state)
    app = build_server(
        model_manager,
        chat,
        completion_handler=CompletionHandler(model_manager=model_manager, generation_state=generation_state),
        response_handler=ResponseHandler(model_manager=model_manager, generation_state=generation_state),
        transcription_handler=TranscriptionHandler(model_manager),
        systemone_handler=SystemOneHandler(model_manager=model_manager, generation_state=generation_state),
    )
    engine = model_manager.get_engine(None)
    config = engine.generation_config
    limits = Limits(
        max_model_len=generation_state.context_length(engine.model_config),
        # transformers' default tokens to generate (BaseHandler._build_generation_kwargs): the model's, at least 1024
        default_new_tokens=max(config.max_new_tokens or 0, 1024),
    )

    async def count_prompt(path: str, body: dict[str, Any]) -> int:
        """The prompt's tokens, rendered as transformers' handler renders it (on its tokenizer thread)."""
        if path == "/v1/completions":
            tokenizer = getattr(engine.processor, "tokenizer", engine.processor)
            inputs = await chat.run_in_thread(tokenizer, body["prompt"])
        else:
            messages = body["messages"] if path == "/v1/chat/completions" else response_messages(body)
            inputs = await chat.run_in_thread(chat.render_messages, engine, messages, body)
        return len(inputs["input_ids"])

    # the seeds of requests that send none: --default-seed makes them a sequence (in arrival order)
    seeds = random.Random(generation_state.seed) if generation_state.seed is not None else None
    door_options = {"api_key": api_key, "admin": admin, "max_requests": max_requests, "seeds": seeds}
    app.add_middleware(FrontDoor, limits=limits, count_prompt=count_prompt, **door_options)

    def front_door() -> FrontDoor | None:  # Starlette builds the middleware stack at the first request
        stack = app.middleware_stack
        while stack is not None and not isinstance(stack, FrontDoor):
            stack = getattr(stack, "app", None)
        return stack

    async def engine_stats() -> dict[str, Any]:
        current = model_manager.get_engine(None)
        return await current.submit(engine_metrics) if current.process_running else {}

    @asynccontextmanager
    async def check_engine(_app: FastAPI) -> Any:  # FastAPI runs it after transformers' own start
        try:
            stats = await engine_stats()
        except Exception as exc:
            print(f"graphrunner serve: {exc}", file=sys.stderr, flush=True)
            raise
        page = getattr(generation_state.cb_config, "page_size", None)
        if stats.get("cache_blocks") and page:  # the paged cache as the engine made it
            limits.cache_tokens = int(stats["cache_blocks"]) * int(page)
        yield

    router = APIRouter(lifespan=check_engine)

    @router.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        door = front_door()
        http = door.http if door is not None else {}
        front = {"in_flight": door.in_flight if door else 0, "max_requests": max_requests}
        if door is not None:
            front["refused_busy"] = door.refused_busy
        text = _metrics_text(await engine_stats(), http, model_id, front)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @router.get("/ready")
    async def ready() -> Response:
        """Readiness, not liveness (``/health``): 200 once every planned graph is captured, 503 before."""
        stats = await engine_stats()
        body = {k: stats.get(k, 0) for k in ("graphs_planned", "graphs_captured")}
        body["ready"] = bool(stats.get("ready", 0))
        return Response(json.dumps(body), status_code=200 if body["ready"] else 503, media_type="application/json")

    app.include_router(router)
    return app


def serve(args: argparse.Namespace) -> int:
    """Run ``graphrunner serve`` with parsed ``args`` until SIGTERM or Ctrl+C (then exit 0); ``--tp N`` (N > 1):
    on N tensor-parallel ranks (:func:`graphrunner_tools.serve_tp.serve_tp`)."""
    if getattr(args, "tp", 1) > 1:
        from graphrunner_tools.serve_tp import serve_tp

        return serve_tp(args, (serve_http, engine_parts))
    return serve_http(args)


def engine_parts(args: argparse.Namespace) -> tuple[str, Any, Any, dict[str, Any] | None]:
    """``(model_dir, cb_config, generation_state, graph_options)`` of ``args``: what every rank's engine is
    made of (transformers' ``ContinuousBatchingConfig`` and ``GenerationState``; ``None`` options: ``--eager``)."""
    from transformers import ContinuousBatchingConfig
    from transformers.cli.serving.utils import GenerationState

    from graphrunner_tools.models.tiny_chat import tiny_model_dir

    model = os.path.abspath(args.model or tiny_model_dir(args.tiny_dir))
    cb = {_CB_NAMES.get(name, name[3:]): getattr(args, name) for name in _CB_OPTIONS if getattr(args, name)}
    cb.setdefault("use_cuda_graph", False)  # graphrunner captures the step (transformers' own graphs pad it)
    if args.eager:
        cb.pop("use_cuda_graph")
    cb_config = ContinuousBatchingConfig(**cb)
    max_model_len = args.max_model_len
    if max_model_len is None and args.cb_num_blocks and args.cb_block_size:
        from transformers import AutoConfig

        # a longer request cannot fit the paged cache: refused at the request (400), not failed in the engine
        context = getattr(AutoConfig.from_pretrained(model).get_text_config(), "max_position_embeddings", None)
        max_model_len = min(args.cb_num_blocks * args.cb_block_size, context or 1 << 62)
    options = None if args.eager else _graph_options(args)
    state = GenerationState(
        continuous_batching=True, cb_config=cb_config, seed=args.default_seed, max_model_len=max_model_len
    )
    return model, cb_config, state, options


#: Seconds an idle HTTP/1.1 connection is kept open (uvicorn's ``timeout_keep_alive``, 5 by default): above the
#: 5 s after which httpx (the openai client) stops reusing one, so the client always lets go first.
KEEP_ALIVE_S = 30


def serve_http(args: argparse.Namespace) -> int:
    """The HTTP server and its model's process (the driver rank under ``--tp``)."""
    import gc

    import uvicorn
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import freeze_garbage_collector, set_serve_log_level
    from transformers.utils import logging as hf_logging

    level = hf_logging.log_levels[args.log_level.lower()]
    set_serve_log_level(level, False)
    model, cb_config, state, options = engine_parts(args)
    from graphrunner_tools.serve_engine import GraphModelLoader, loader_arguments

    if getattr(args, "tp", 1) > 1:
        from graphrunner_tools.serve_tp import make_loader

        loader: GraphModelLoader = make_loader(args, options)
    else:
        loader = GraphModelLoader(options, capture_first=args.capture_first, **loader_arguments(args))
    what = "eager: no graphs" if options is None else "graphs: " + json.dumps(options)
    if args.capture_first:
        what += "; every key captured before the server answers (--capture-first, the default)"
    print(f"graphrunner serve: loading {model} ({what})", file=sys.stderr, flush=True)
    try:
        model_manager = ModelManager(loader, state, model_timeout=-1, force_model=model)
    except RuntimeError as exc:  # the model's process failed to load it: transformers' message says why
        print(f"graphrunner serve: could not load {model!r} and start its engine: {exc}", file=sys.stderr)
        return 1
    api_key = args.api_key if args.api_key is not None else os.environ.get("GRAPHRUNNER_API_KEY") or None
    app = build_app(
        model_manager, state, model, api_key=api_key, admin=args.admin, max_requests=args.max_concurrent_requests
    )

    async def stop_if_the_engine_died() -> None:
        # transformers fails the engine's requests when it dies (a 500, a 503 for those that come after) and marks
        # the model's client dead; the server then stops at once and exits 1, never a process answering 503
        if model_manager.is_dead and not server.should_exit:
            reasons = "; ".join(f"{e.fatal_error}" for e in model_manager.engines.values() if e.is_dead)
            print(f"graphrunner serve: the engine died ({reasons}): exiting 1", file=sys.stderr, flush=True)
            server.should_exit = True

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        callback_notify=stop_if_the_engine_died,
        timeout_notify=0,  # uvicorn calls it at most once a second: every second
        timeout_graceful_shutdown=args.shutdown_timeout,
        # longer than a client's own keep-alive expiry (httpx's, the openai client's: 5 s), so the server never
        # closes an idle connection the client is sending a request on (uvicorn's 5 s raced it: a ReadError)
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    server = uvicorn.Server(config)
    # uvicorn stops on SIGTERM / Ctrl+C, then raises the signal again for the handler found before it:
    # this one, so the process ends as a clean stop (exit 0), not killed by the signal
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda *_: None)
    print(
        f"graphrunner serve: http://{args.host}:{args.port}/v1 (model {model!r}; GET /metrics)",
        file=sys.stderr,
        flush=True,
    )
    freeze_garbage_collector()
    try:
        server.run()
    finally:
        gc.unfreeze()
        model_manager.shutdown()
    return 1 if model_manager.is_dead or not server.started else 0  # not started: the start failed (printed)


def _graph_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {
        "backend": args.backend,
        "device": args.graph_device,
        "replan_every": args.replan_every,
        "replan_share": args.replan_share,
        "capture_share": args.capture_share,
        "attention": args.attention,
    }
    if args.buckets is not None:
        options["buckets"] = args.buckets
    if args.max_graphs is not None:
        options["max_graphs"] = args.max_graphs
    return options


def _dims_buckets(text: str) -> dict[str, list]:
    """``tokens=8,32,64;kv=128,512;reqs=4,8`` -> ``{"tokens": [8, 32, 64], ...}``."""
    out: dict[str, list] = {}
    for part in text.split(";"):
        name, _, sizes = part.partition("=")
        if not name.strip() or not sizes:
            raise argparse.ArgumentTypeError(
                f"expected dim=size,size;... such as 'tokens=8,64;kv=256;reqs=8', got {text!r}"
            )
        try:
            out[name.strip()] = sorted(int(v) for v in sizes.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"sizes of {name.strip()!r} must be integers, got {sizes!r}") from None
    return out


def _dims_counts(text: str) -> dict[str, int]:
    """``--max-graphs``: ``tokens=4,kv=4,reqs=2`` (``graphrunner plan``'s syntax), or ``4`` for every dim."""
    from graphrunner_tools.plan import parse_max_graphs

    got = parse_max_graphs(text)
    out = {d: got for d in ("tokens", "kv", "reqs")} if isinstance(got, int) else got
    if any(n < 1 for n in out.values()):
        raise argparse.ArgumentTypeError(f"every count must be >= 1, got {text!r}")
    return out


def add_serve_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``graphrunner serve`` to ``subparsers``."""
    p = subparsers.add_parser(
        "serve",
        help="serve a transformers model over an OpenAI-compatible HTTP API, its steps replayed from graphs",
        description="transformers' own server (transformers serve --continuous-batching: /v1/chat/completions, "
        "/v1/completions, /v1/responses, streaming) with its continuous-batching steps replayed from "
        "graphrunner graphs, all captured before it answers (or beside the first requests: "
        "--capture-in-background); GET /metrics in "
        "Prometheus' format. MODEL_DIR: a local transformers model directory (omit it for a tiny "
        "built-in model with random weights). Needs the serve extra: pip install -e '.[serve]'. "
        "SIGTERM or Ctrl+C stops it (exit 0). See docs/serving.md.",
    )
    p.add_argument(
        "model",
        metavar="MODEL_DIR",
        nargs="?",
        default=None,
        help="a local model directory (config, weights, tokenizer with a chat template); default: the "
        "built-in tiny model",
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    p.add_argument("--device", default="auto", help="the model's torch device, as transformers serve (default auto)")
    p.add_argument("--dtype", default="auto", help="the model's dtype, as transformers serve (default auto)")
    p.add_argument(
        "--attn-implementation",
        default="sdpa",
        help="attention implementation (default sdpa; graphs need a masked one: sdpa or eager)",
    )
    p.add_argument("--cb-block-size", type=int, default=16, help="KV cache block size in tokens (default 16)")
    p.add_argument(
        "--cb-num-blocks",
        type=int,
        default=256,
        help="KV cache blocks (default 256: 4,096 tokens; 0: transformers sizes the cache from free "
        "memory, most of a CPU machine's RAM)",
    )
    p.add_argument("--cb-max-batch-tokens", type=int, default=256, help="most query tokens in one step (default 256)")
    p.add_argument("--cb-max-memory-percent", type=float, default=None, help="most memory for the KV cache (0-1)")
    p.add_argument("--cb-max-requests", type=int, default=64, help="most requests in one step (default 64)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest request, prompt and answer, in tokens (default: the model's context, or the paged "
        "cache's blocks x block size when both are given); a longer one is a 400",
    )
    p.add_argument(
        "--default-seed",
        type=int,
        default=None,
        help="seeds the seeds of the requests that send none, in the order they come, and the model process's "
        "torch (default: each such request gets a random seed)",
    )
    p.add_argument("--log-level", default="warning", help="log level of the server (default warning)")
    p.add_argument(
        "--eager",
        action="store_true",
        help="serve without graphs: transformers' own engine, everything else the same (the reference)",
    )
    p.add_argument(
        "--backend",
        default="full",
        choices=("full", "breakable", "eager"),
        help="graphrunner backend (default full: the whole forward in one graph)",
    )
    p.add_argument(
        "--graph-device",
        default="auto",
        choices=("auto", "cuda", "tape"),
        help="graphs: CUDA graphs on a GPU, the CPU tape otherwise (default auto)",
    )
    p.add_argument(
        "--buckets",
        type=_dims_buckets,
        default=None,
        help="fixed buckets per dim, e.g. 'tokens=8,64;kv=256,1024;reqs=8' (default: a ladder up to the "
        "configured sizes, re-planned from the steps served)",
    )
    p.add_argument(
        "--max-graphs",
        type=_dims_counts,
        default=None,
        help="buckets per dim of the ladder and of a re-plan, e.g. 'tokens=5,kv=4,reqs=3'",
    )
    p.add_argument(
        "--replan-every",
        type=int,
        default=2048,
        help="re-plan the keys from the steps served every N steps when that cuts the padding to 60%% "
        "or less (0: never; default 2048: each re-plan captures its keys beside the serving)",
    )
    p.add_argument(
        "--replan-share",
        type=float,
        default=0.1,
        help="the share of the serving time background captures may take: a re-plan waits after the last "
        "capture until they would take no more (default 0.1: 9x the last capture's seconds; 1: no wait)",
    )
    p.add_argument(
        "--capture-share",
        type=float,
        default=CAPTURE_SHARE,
        help="the share of the time a capture's keys take while requests are served: after a key that took d s "
        f"the capture rests d*(1-share)/share s, or until no step came for 50 ms (default {CAPTURE_SHARE}; "
        "1: keys back to back, a waiting step first)",
    )
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--capture-first",
        action="store_true",
        default=None,
        help="capture every key of the ladder before the server answers, as vLLM and SGLang capture their CUDA "
        "graphs at start (the default with a graph backend): /health answers only once every planned graph is "
        "captured, at full speed (no step beside it; with --tp, on every rank, at the loop's idle iterations), "
        "so every step replays from the first request; the start takes the capture's seconds more (keys "
        "captured of planned shown meanwhile), and a capture that fails stops the start (exit 1) naming the "
        "error. Not with --eager",
    )
    when.add_argument(
        "--capture-in-background",
        action="store_true",
        help="answer at once and capture the ladder beside the first requests, which are served more slowly "
        "meanwhile (--capture-share); /ready turns 200 once every key is captured",
    )
    p.add_argument(
        "--attention",
        choices=("auto", "per_request", "dense"),
        default="auto",
        help="the step's attention: per_request (each request's queries against its own keys; the CPU tape), "
        "dense (the [tokens, kv] masks CUDA graphs replay), auto (per_request on the tape, dense on CUDA graphs)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds SIGTERM waits for requests in flight before cancelling them (default 5)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (401 otherwise); default: the "
        "environment's GRAPHRUNNER_API_KEY, or none (open)",
    )
    p.add_argument(
        "--admin",
        action="store_true",
        help="open transformers' routes that reset the engine or load another model (/reset, /load_model; "
        "404 without it)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=256,
        help="most generation requests in flight, generating or queued (default 256); beyond it a 429 with Retry-After",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (default 1): rank 0 serves HTTP and drives, the others follow step by step; "
        "started with torch's elastic launcher, or joined from torchrun (torchrun --nproc-per-node N -m "
        "graphrunner_tools serve MODEL_DIR --tp N); gloo on CPUs, NCCL on GPUs",
    )
    p.add_argument(
        "--tp-timeout",
        type=float,
        default=60.0,
        help="--tp: seconds the ranks' rendezvous and each of their collectives may take (default 60)",
    )
    p.add_argument(
        "--tp-debug",
        action="store_true",
        help="--tp: compare every rank's sampled tokens at every step and fail naming the step and the "
        "requests that differ (one all-gather per step)",
    )
    p.add_argument("--tiny-dir", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=serve, check=_check)
    return p


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client", "transformers") if not _importable(m)]
    if missing:
        parser.error(f"graphrunner serve needs {', '.join(missing)}: pip install -e '.[serve]'")
    if args.model is not None and not os.path.isdir(args.model):
        parser.error(
            f"MODEL_DIR {args.model!r} is not a directory holding a transformers model (config.json, "
            "weights, tokenizer): graphrunner serve loads local models only, or none for the built-in tiny "
            "model"
        )
    if args.replan_every < 0:
        parser.error(f"argument --replan-every: must be >= 0 (0: never), got {args.replan_every}")
    if not 0 < args.replan_share <= 1:
        parser.error(f"argument --replan-share: must be in (0, 1], got {args.replan_share}")
    if not 0 < args.capture_share <= 1:
        parser.error(f"argument --capture-share: must be in (0, 1], got {args.capture_share}")
    if args.max_concurrent_requests < 1:
        parser.error(f"argument --max-concurrent-requests: must be >= 1, got {args.max_concurrent_requests}")
    if not 0 < args.port < 65536:
        parser.error(f"argument --port: must be 1..65535, got {args.port}")
    if args.tp < 1:
        parser.error(f"argument --tp: must be >= 1 (tensor-parallel ranks), got {args.tp}")
    if args.capture_in_background and args.eager:
        parser.error(
            "argument --capture-in-background: not allowed with --eager, which serves without graphs (nothing to "
            "capture); drop one of them"
        )
    if args.capture_first and args.eager:
        parser.error(
            "argument --capture-first: not allowed with --eager, which serves without graphs (nothing to capture); "
            "drop one of them"
        )
    if not args.tp_timeout > 0:
        parser.error(f"argument --tp-timeout: must be > 0 seconds, got {args.tp_timeout}")
    if args.capture_first is None:  # the default: capture before serving wherever a graph replays
        args.capture_first = not args.eager and args.backend != "eager" and not args.capture_in_background


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
