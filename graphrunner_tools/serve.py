"""``graphrunner serve``: transformers' own OpenAI-compatible server, its continuous-batching steps replayed from graphs.

What is transformers' and what is ours. The HTTP app, its routes and
handlers (chat completions, completions, responses, streaming, the OpenAI
schemas, request validation, cancel on disconnect), the model's process and
its continuous-batching manager are ``transformers serve --continuous-batching``'s,
used as they are (:mod:`transformers.cli.serving`). graphrunner adds three
things and nothing else:

- the model loader (:class:`graphrunner_tools.serve_engine.GraphModelLoader`, which runs in the model's
  process) installs :func:`graphrunner.hf.init_continuous_batching` with
  ``autocapture=True`` on every manager the model makes: graphs are captured in
  the background from the first step, keys from a ladder, re-planned from the
  steps served (``docs/serving.md``). ``--eager`` serves without graphs
  (transformers' own engine, the same command and flags otherwise);
- ``GET /metrics``: Prometheus text (``prometheus_client``) of the graphs, the
  engine and the HTTP requests (:func:`~graphrunner_tools.serve_engine.engine_metrics` runs in the model's
  process through transformers' ``EngineClient.submit``);
- with no model on the command line, a tiny built-in model
  (:func:`tiny_model_dir`: random weights, a byte tokenizer with a chat
  template, built locally), so the server runs on a fresh machine with no
  download.

Tested with transformers 5.25 (:data:`graphrunner.hf.decode.VERIFIED_TRANSFORMERS_MAJOR`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any

__all__ = ["ServerProcess", "add_serve_subparser", "build_app", "serve", "tiny_model_dir"]

logger = logging.getLogger("graphrunner")

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
    ("gauge", "graphrunner_graphs_enabled", "graphs_on", "1 when the steps are served from graphs"),
    ("gauge", "graphrunner_graphs_planned", "graphs_planned", "keys (graphs) planned"),
    ("gauge", "graphrunner_graphs_captured", "graphs_captured", "graphs captured and replaying"),
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


def _metrics_text(engine: dict[str, Any], http: dict[tuple, int], model_id: str) -> bytes:
    """The Prometheus exposition of ``engine`` (:func:`engine_metrics`) and ``http`` ((path, status) -> count)."""
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
            req = CounterMetricFamily(
                "graphrunner_http_requests", "HTTP requests answered, by path and status", labels=["path", "status"]
            )
            for (path, status), n in sorted(http.items()):
                req.add_metric([path, str(status)], n)
            yield req

    registry = CollectorRegistry()
    registry.register(Snapshot())
    return generate_latest(registry)


def _checked(handler: Any) -> Any:
    """transformers' endpoint ``handler`` class, refusing a request for fewer than 1 new token as the
    client's error (``ValueError``: the app answers 400; transformers' engine fails such a request
    with a 500)."""

    class Checked(handler):  # type: ignore[misc, valid-type]
        def _build_generation_kwargs(self, body: dict, model_generation_config: Any) -> dict:
            out = super()._build_generation_kwargs(body, model_generation_config)
            n = out.get("max_new_tokens")
            if n is not None and int(n) < 1:
                field = next(
                    (
                        f
                        for f in ("max_completion_tokens", "max_tokens", "max_output_tokens")
                        if body.get(f) is not None
                    ),
                    "max_tokens",
                )
                raise ValueError(f"{field} must be at least 1 (the tokens to generate), got {n}")
            return out

    Checked.__name__ = Checked.__qualname__ = handler.__name__
    return Checked


def build_app(serve: Any, model_manager: Any) -> Any:
    """transformers serve's FastAPI app (its ``build_server`` with its handlers, as ``Serve.run`` builds
    them) plus ``GET /metrics``. ``serve``: a ``transformers.cli.serve.Serve`` whose settings are set."""
    from fastapi import Request, Response
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler

    state, kwargs = serve.generation_state, serve.chat_template_kwargs
    app = build_server(
        model_manager,
        _checked(ChatCompletionHandler)(
            model_manager=model_manager, generation_state=state, chat_template_kwargs=kwargs
        ),
        completion_handler=_checked(CompletionHandler)(model_manager=model_manager, generation_state=state),
        response_handler=_checked(ResponseHandler)(
            model_manager=model_manager, generation_state=state, chat_template_kwargs=kwargs
        ),
        transcription_handler=TranscriptionHandler(model_manager),
        systemone_handler=SystemOneHandler(
            model_manager=model_manager,
            generation_state=state,
            chat_template_kwargs=kwargs,
            decision_config=serve.decision_config,
        ),
        enable_cors=serve.enable_cors,
    )
    http: dict[tuple, int] = {}

    @app.middleware("http")
    async def count(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        key = (request.url.path, response.status_code)
        http[key] = http.get(key, 0) + 1
        return response

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        from graphrunner_tools.serve_engine import engine_metrics

        engine = model_manager.get_engine(None)
        stats = await engine.submit(engine_metrics) if engine.process_running else {}
        return Response(_metrics_text(stats, http, serve.force_model), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(args: argparse.Namespace) -> int:
    """Run ``graphrunner serve`` with parsed ``args`` until SIGTERM or Ctrl+C (then exit 0)."""
    import gc

    import uvicorn
    from transformers import ContinuousBatchingConfig
    from transformers.cli.serve import Serve
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import GenerationState, freeze_garbage_collector, set_serve_log_level
    from transformers.utils import logging as hf_logging

    model = os.path.abspath(args.model or tiny_model_dir(args.tiny_dir))
    level = hf_logging.log_levels[args.log_level.lower()]
    set_serve_log_level(level, False)
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
    srv = Serve.__new__(Serve)  # its settings, without its __init__ (which would run transformers' own server)
    srv.log_level, srv.enable_log_requests = level, False
    srv.generation_state = GenerationState(
        continuous_batching=True, cb_config=cb_config, seed=args.default_seed, max_model_len=max_model_len
    )
    from graphrunner_tools.serve_engine import GraphModelLoader

    srv.loader = GraphModelLoader(
        options,
        device=args.device,
        dtype=args.dtype,
        trust_remote_code=False,
        attn_implementation=args.attn_implementation,
        quantization=None,
        continuous_batching=True,
    )
    srv.chat_template_kwargs, srv.decision_config = {}, None
    srv.force_model, srv.model_timeout, srv.enable_cors = model, -1, False
    srv.host, srv.port = args.host, args.port
    print(
        f"graphrunner serve: loading {model} ({'eager: no graphs' if options is None else 'graphs: ' + json.dumps(options)})",
        file=sys.stderr,
        flush=True,
    )
    try:
        model_manager = ModelManager(srv.loader, srv.generation_state, model_timeout=-1, force_model=model)
    except RuntimeError as exc:  # the model's process failed to load it: transformers' message says why
        print(f"graphrunner serve: could not load {model!r}: {exc}", file=sys.stderr)
        return 1
    app = build_app(srv, model_manager)

    async def stop_if_the_engine_died() -> None:
        if model_manager.is_dead:
            server.should_exit = True

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        callback_notify=stop_if_the_engine_died,
        timeout_notify=5,
        timeout_graceful_shutdown=args.shutdown_timeout,
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
    return 1 if model_manager.is_dead else 0


def _graph_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {
        "backend": args.backend,
        "device": args.graph_device,
        "replan_every": args.replan_every,
        "replan_share": args.replan_share,
    }
    if args.buckets is not None:
        options["buckets"] = args.buckets
    if args.max_graphs is not None:
        options["max_graphs"] = args.max_graphs
    return options


def tiny_model_dir(folder: str | None = None) -> str:
    """A directory holding the built-in tiny chat model, made once (random weights, seeded; a
    character tokenizer with a chat template, built locally; nothing downloaded): a Llama of 2
    layers, hidden 64, 99 tokens (the 95 printable ASCII characters, newline, ``<|im_start|>``,
    ``<|im_end|>``, ``<|pad|>``), 2048 positions. ``folder``: where (default ``$GRAPHRUNNER_CACHE`` or ``~/.cache/graphrunner``,
    then ``tiny-chat-3``); an existing complete one is reused."""
    root = folder or os.path.join(
        os.environ.get("GRAPHRUNNER_CACHE") or os.path.expanduser("~/.cache/graphrunner"), "tiny-chat-3"
    )
    done = os.path.join(root, ".complete")
    if os.path.exists(done):
        return root
    import tempfile

    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-chat-", dir=os.path.dirname(os.path.abspath(root)))
    chars = [chr(c) for c in range(32, 127)] + ["\n"]  # printable: any token sequence decodes to text and back
    specials = ["<|im_start|>", "<|im_end|>", "<|pad|>"]
    tok = Tokenizer(models.WordLevel(vocab={ch: i for i, ch in enumerate(chars)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token a character
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|pad|>"
    )
    fast.chat_template = template
    fast.save_pretrained(tmp)
    eos, pad = fast.convert_tokens_to_ids("<|im_end|>"), fast.convert_tokens_to_ids("<|pad|>")
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=fast.bos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )  # untied, wide: greedy answers vary with the prompt
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=False)
    model.save_pretrained(tmp)
    with open(os.path.join(tmp, ".complete"), "w") as f:
        f.write("graphrunner tiny chat model\n")
    try:
        os.replace(tmp, root)
    except OSError:  # another process made it first: use theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return root


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
        "graphrunner graphs, captured in the background from the first request; GET /metrics in "
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
        "cache's blocks x block size when both are given); a longer prompt is a 400",
    )
    p.add_argument("--default-seed", type=int, default=None, help="torch seed of the model's process")
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
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds SIGTERM waits for requests in flight before cancelling them (default 5)",
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
    if not 0 < args.port < 65536:
        parser.error(f"argument --port: must be 1..65535, got {args.port}")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


class ServerProcess:
    """A ``graphrunner serve`` process on a free port of 127.0.0.1 (tests and ``bench/serve_sweep.py``).

    ``ServerProcess(flags, log_path, start_timeout=180, env=None)`` starts ``python -m graphrunner_tools
    serve --port <free> *flags`` with its output in ``log_path`` and returns once ``/health`` answers
    200; raises ``RuntimeError`` with the log's tail when it exits or does not listen in time.
    :attr:`url` is its base URL; :meth:`metrics` parses ``/metrics``; :meth:`stop` sends SIGTERM
    and returns the exit code (killed after ``timeout`` seconds)."""

    def __init__(
        self, flags: Any, log_path: str, start_timeout: float = 180.0, env: dict[str, str] | None = None
    ) -> None:
        import socket
        import subprocess
        import time
        import urllib.error
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "graphrunner_tools", "serve", "--port", str(self.port), *flags],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"graphrunner serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"graphrunner serve did not listen within {start_timeout:.0f} s:\n{self.output()}")
            time.sleep(0.5)

    def output(self, tail: int = 4000) -> str:
        """The last ``tail`` characters the server printed."""
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-tail:]

    def metrics(self) -> dict[str, float]:
        """``GET /metrics`` as ``{"name{labels}": value}``."""
        import urllib.request

        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def metric(self, name: str) -> float:
        """The sum of metric ``name`` over its labels."""
        return sum(v for k, v in self.metrics().items() if k == name or k.startswith(name + "{"))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Send ``sig`` and wait up to ``timeout`` s (then kill); the exit code."""
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
