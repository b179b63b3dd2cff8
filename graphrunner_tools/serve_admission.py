"""The front door of ``graphrunner serve``: what a request must be to reach transformers' app and its engine.

One ASGI middleware, :class:`FrontDoor`, in front of transformers' FastAPI app (public ASGI seams only:
it reads the request, answers it or hands it on, and watches what is sent back):

- ``--api-key``: every route but ``/health`` needs ``Authorization: Bearer KEY`` (401 otherwise);
- the routes that reset or reload the model (:data:`ADMIN_ROUTES`) answer 404 unless ``--admin``;
- ``--max-concurrent-requests``: a generation request beyond that many in flight or queued is a 429 with
  ``Retry-After``;
- every parameter of a generation request is honoured or refused (:func:`check_request`), messages
  malformed are refused, and a request whose prompt tokens (the model's tokenizer and chat template, as
  transformers renders them) plus the tokens to generate exceed the context (``--max-model-len``) or the
  paged cache is refused (:func:`check_length`), all with a 400 and an OpenAI error object naming the
  field: no request reaches the engine in a state that kills it;
- each request's sampling is its own, whatever the model's generation config says: the request reaches
  transformers' app with its temperature, top-k and top-p spelled out and a seed (one drawn for it when it
  sends none; :func:`admitted_body`), which the engine's per-request sampler takes
  (:class:`graphrunner_tools.serve_engine.ServedManager`);
- a chat or completions stream ends with ``data: [DONE]``, OpenAI's wire format;
- HTTP requests are counted by path and status (``/metrics``), a client that left before its answer as
  499, without a traceback;
- a generation request the engine failed (a step that raised) is a 500 with an OpenAI error object
  (``server_error``, code ``engine_error``) whose message names the error, logged in one line (transformers'
  app lets it reach the ASGI server, which answers a bare "Internal Server Error" and logs a traceback); a
  stream that had started ends with transformers' error event.

The checks are plain functions of the request body (:func:`check_request`, :func:`check_length`), each
error a :class:`RequestError`; docs/serving.md has the table of parameters, honoured or refused.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ADMIN_ROUTES",
    "GENERATION_ROUTES",
    "FrontDoor",
    "Limits",
    "RequestError",
    "Sampling",
    "admitted_body",
    "check_length",
    "check_request",
    "request_sampling",
    "requested_new_tokens",
    "response_messages",
]

logger = logging.getLogger("graphrunner")

#: The generation routes and the field each reads for the tokens to generate (transformers' order: first set wins).
GENERATION_ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/chat/completions": ("max_completion_tokens", "max_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
}
#: transformers' routes that reset the engine or load another model: closed unless ``--admin``.
ADMIN_ROUTES = frozenset({"/reset", "/load_model"})
#: Routes that answer without an API key.
OPEN_ROUTES = frozenset({"/health", "/ready"})
#: Chat roles a message may have (OpenAI's).
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

#: Parameters the engine does not honour, by route, with the values that ask for nothing (accepted as no-ops).
#: transformers' handlers pass ``stop``, ``frequency_penalty`` and ``logit_bias`` on to ``generate``'s
#: arguments, but its continuous-batching engine takes only ``max_new_tokens``, ``eos_token_id`` and the
#: sampling settings from a request (``CBGenerateRunner``): the others would be ignored.
_NO_OPS: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "stop": (None, [], ""),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "text": (None, {"format": {"type": "text"}}),
    "tool_choice": (None, "auto"),
    "parallel_tool_calls": (None, True),
    "functions": (None, []),
    "function_call": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "reasoning": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "metadata": (None, {}),
    "background": (None, False),
    "include": (None, []),
    "previous_response_id": (None,),
    "prompt": (None,),  # the Responses API's prompt template (the completions' prompt is checked apart)
    "max_tool_calls": (None,),
    "truncation": (None, "disabled"),
    "service_tier": (None, "auto", "default"),
}
_NOT_FOR_COMPLETIONS = {"prompt"}
#: ``generation_config`` (transformers' JSON of generation settings) keys the engine honours per request.
_GENERATION_CONFIG_KEYS = frozenset({"max_new_tokens", "eos_token_id", "do_sample", "temperature", "top_p", "top_k"})


class RequestError(ValueError):
    """A request the server refuses: ``status`` (400 unless said) and an OpenAI error object
    (:meth:`body`) naming the field (``param``)."""

    def __init__(self, message: str, param: str | None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    """What the served engine can take, read once as the server starts.

    ``max_model_len``: the longest request, prompt and answer, in tokens (transformers'
    ``GenerationState.context_length``: ``--max-model-len`` or the model's context); ``cache_tokens``: the
    paged cache's blocks x block size (``None``: not known yet); ``default_new_tokens``: the tokens to
    generate when a request names none (transformers': the model's ``max_new_tokens``, at least 1024)."""

    max_model_len: int | None = None
    cache_tokens: int | None = None
    default_new_tokens: int = 1024

    @property
    def tokens(self) -> int | None:
        """The most tokens one request may hold, prompt and answer: the smaller of the context and the cache."""
        known = [n for n in (self.max_model_len, self.cache_tokens) if n is not None]
        return min(known) if known else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: The seeds ``torch.manual_seed`` takes (what a request's ``seed`` seeds: its own generator).
SEEDS = range(-(2**63), 2**64)


def _sampling(name: str, value: Any, where: str) -> None:
    """``temperature``, ``top_p`` or ``top_k`` of a request: in range (each request samples with its own)."""
    if value is None:
        return
    if name == "top_k":
        if not _is_int(value) or value < -1:
            raise RequestError(f"{where} must be an integer >= 0 (0 or -1: off), got {value!r}", where)
    elif not _is_number(value):
        raise RequestError(f"{where} must be a number, got {value!r}", where)
    elif name == "temperature" and not 0 <= value <= 2:
        raise RequestError(f"{where} must be between 0 and 2, got {value!r}", where)
    elif name == "top_p" and not 0 < value <= 1:
        raise RequestError(f"{where} must be greater than 0 and at most 1, got {value!r}", where)


def _generation_config(body: dict[str, Any]) -> dict[str, Any]:
    """The request's ``generation_config`` (transformers' JSON of generation settings) as a dict (checked)."""
    text = body.get("generation_config")
    return json.loads(text) if text else {}


def _check_generation_config(text: Any) -> None:
    if text is None:
        return
    try:
        settings = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        settings = None
    if not isinstance(settings, dict):
        raise RequestError(f"generation_config must be a JSON object in a string, got {text!r}", "generation_config")
    unknown = sorted(set(settings) - _GENERATION_CONFIG_KEYS)
    if unknown:
        raise RequestError(
            f"generation_config: {', '.join(unknown)} not supported: the continuous-batching engine takes "
            f"{', '.join(sorted(_GENERATION_CONFIG_KEYS))} from a request",
            "generation_config",
        )
    n = settings.get("max_new_tokens")
    if n is not None and (not _is_int(n) or n < 1):
        raise RequestError(
            f"generation_config's max_new_tokens must be an integer >= 1, got {n!r}", "generation_config"
        )
    if settings.get("do_sample") is not None and not isinstance(settings["do_sample"], bool):
        raise RequestError(
            f"generation_config's do_sample must be true or false, got {settings['do_sample']!r}", "generation_config"
        )
    for name in ("temperature", "top_p", "top_k"):
        try:
            _sampling(name, settings.get(name), f"generation_config.{name}")
        except RequestError as exc:
            raise RequestError(exc.message, "generation_config") from None


@dataclass(frozen=True)
class Sampling:
    """How a request samples, whatever the model's generation config says: ``temperature`` (0: greedy),
    ``top_k`` (0: off), ``top_p`` (1: off)."""

    temperature: float
    top_k: int
    top_p: float


def request_sampling(body: dict[str, Any]) -> Sampling:
    """How a checked request (:func:`check_request`) samples: its ``temperature``, else ``generation_config``'s,
    else 1 where ``generation_config`` says ``do_sample: true``, else 0 (greedy); ``do_sample: false`` is
    greedy whatever the temperature (as transformers' ``generate``). ``top_p`` and ``top_k`` (vLLM's
    parameter, beside OpenAI's): the request's, else ``generation_config``'s, else off (1 and 0; ``top_k``
    -1 is off too). The model's own generation config is not read: the request says all."""
    config = _generation_config(body)
    temperature = body.get("temperature")
    if temperature is None:
        temperature = config.get("temperature")
    if temperature is None:
        temperature = 1.0 if config.get("do_sample") else 0.0
    if config.get("do_sample") is False:
        temperature = 0.0
    top_p = body.get("top_p") if body.get("top_p") is not None else config.get("top_p")
    top_k = body.get("top_k") if body.get("top_k") is not None else config.get("top_k")
    return Sampling(float(temperature), max(int(top_k or 0), 0), float(1.0 if top_p is None else top_p))


def admitted_body(body: dict[str, Any], seed: int) -> dict[str, Any]:
    """A checked request's body as transformers' app gets it: its sampling (:func:`request_sampling`) spelled
    out in its ``generation_config`` (``do_sample``, and ``temperature``, ``top_k``, ``top_p`` when it
    samples), so that transformers' handler hands the engine exactly these and not the model's defaults;
    ``top_k`` moved there (transformers' schemas have no ``top_k``); a ``seed`` always (``seed``: the one to
    give a request that sends none), as the engine seeds each request's own generator with it."""
    sampling = request_sampling(body)
    config = {
        k: v for k, v in _generation_config(body).items() if k not in ("do_sample", "temperature", "top_k", "top_p")
    }
    if sampling.temperature > 0:
        config.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    else:
        config["do_sample"] = False
    out = {k: v for k, v in body.items() if k != "top_k"}
    out["generation_config"] = json.dumps(config)
    if out.get("seed") is None:
        out["seed"] = seed
    return out


def _check_content(content: Any, where: str, role: str) -> None:
    if content is None:
        if role == "assistant":  # an assistant turn of tool calls
            return
        raise RequestError(f"{where}.content is missing: a {role} message needs its text", where)
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of parts, got {content!r:.60}", where)
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise RequestError(f"{at} must be an object with a 'type', got {part!r:.60}", at)
        if part["type"] not in ("text", "input_text", "output_text"):
            raise RequestError(f"{at}: content of type {part['type']!r} is not supported by this text model", at)
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{at}.text must be a string, got {part.get('text')!r:.60}", at)


def _check_messages(messages: Any, name: str = "messages") -> None:
    """OpenAI chat messages: a non-empty list of objects, each a role and its content."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"{name} must be a non-empty list of messages, got {messages!r:.60}", name)
    for i, message in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with 'role' and 'content', got {message!r:.60}", where)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {role!r}", where)
        _check_content(message.get("content"), where, role if not message.get("tool_calls") else "assistant")


def response_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a Responses API body (``input`` and ``instructions``) to count its prompt tokens,
    as transformers' handler makes them for the chat template (strings, content lists, messages, function
    call outputs); a function call counts as its whole JSON item (more than the template renders of it);
    :class:`RequestError` for an input transformers' handler cannot take."""
    inp, instructions = body.get("input"), body.get("instructions")
    if isinstance(inp, str):
        messages: list[dict[str, Any]] = [{"role": "user", "content": inp}]
    elif isinstance(inp, list) and inp:
        if not all(isinstance(item, dict) for item in inp):
            raise RequestError("input must be a string or a list of objects", "input")
        if "role" not in inp[0] and inp[0].get("type") not in ("message", "function_call", "function_call_output"):
            messages = [{"role": "user", "content": inp}]  # a flat content list
        else:
            messages = []
            for i, item in enumerate(inp):
                kind = item.get("type")
                if "role" in item:
                    messages.append({"role": item["role"], "content": item.get("content", "")})
                elif kind == "function_call":  # counted as its JSON: the template renders less of it
                    messages.append({"role": "assistant", "content": json.dumps(item)})
                elif kind == "function_call_output":
                    messages.append({"role": "tool", "content": str(item.get("output", ""))})
                elif kind != "reasoning":
                    raise RequestError(f"input[{i}]: items of type {kind!r} are not supported", f"input[{i}]")
    else:
        raise RequestError(f"input must be a string or a non-empty list, got {inp!r:.60}", "input")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions must be a string", "instructions")
    _check_messages(messages, "input")
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    return messages


def check_request(path: str, body: dict[str, Any], limits: Limits) -> None:
    """Refuse (:class:`RequestError`) a generation request (``body``, a JSON object posted to ``path``, one of
    :data:`GENERATION_ROUTES`) with a parameter out of its range, one the engine would ignore, or malformed
    messages. Fields neither OpenAI's nor transformers' are left to transformers' app (422)."""
    for name, no_ops in _NO_OPS.items():
        if name in body and not (path == "/v1/completions" and name in _NOT_FOR_COMPLETIONS):
            value = body[name]
            if not any(value == v and type(value) is type(v) or value is v for v in no_ops) and not (
                name in ("presence_penalty", "frequency_penalty") and _is_number(value) and value == 0
            ):
                what = f"{name}={json.dumps(value)[:60]}"
                raise RequestError(
                    f"{what} is not supported by this server (transformers' continuous-batching engine does not "
                    f"honour it); leave it out" + (" or send n=1" if name in ("n", "best_of") else ""),
                    name,
                    "unsupported_parameter",
                )
    for name in GENERATION_ROUTES[path]:
        value = body.get(name)
        if value is not None and (not _is_int(value) or value < 1):
            raise RequestError(f"{name} must be at least 1 (the tokens to generate), got {value!r}", name)
    for name in ("temperature", "top_p", "top_k"):
        _sampling(name, body.get(name), name)
    for name in ("stream",):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise RequestError(f"{name} must be true or false, got {body[name]!r}", name)
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or seed not in SEEDS):
        raise RequestError(f"seed must be an integer in [-2**63, 2**64), got {seed!r}", "seed")
    _check_generation_config(body.get("generation_config"))
    if path == "/v1/chat/completions":
        if "messages" not in body:
            raise RequestError("messages is missing: a chat completion needs a list of messages", "messages")
        _check_messages(body["messages"])
    elif path == "/v1/completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(f"prompt must be a non-empty string, got {prompt!r:.60}", "prompt")
        if body.get("suffix") is not None and not isinstance(body["suffix"], str):
            raise RequestError("suffix must be a string", "suffix")
    else:
        response_messages(body)


def requested_new_tokens(path: str, body: dict[str, Any], limits: Limits) -> tuple[str | None, int]:
    """``(field, tokens)``: the tokens a request asks to generate, as transformers reads them (its route's
    field, else ``generation_config``'s ``max_new_tokens``, else the default: field ``None``)."""
    for name in GENERATION_ROUTES[path]:
        if body.get(name) is not None:
            return name, int(body[name])
    settings = json.loads(body["generation_config"]) if body.get("generation_config") else {}
    if settings.get("max_new_tokens") is not None:
        return "generation_config", int(settings["max_new_tokens"])
    return None, limits.default_new_tokens


def check_length(path: str, body: dict[str, Any], prompt_tokens: int, limits: Limits) -> int | None:
    """Refuse (:class:`RequestError`, code ``context_length_exceeded``) a request whose ``prompt_tokens`` plus
    the tokens it asks for exceed :attr:`Limits.tokens`, or an empty prompt. A request that names no number
    of tokens gets what the context leaves, at most the default: the number to set (``None``: as asked)."""
    limit = limits.tokens
    where = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}.get(path, "input")
    if prompt_tokens < 1:
        raise RequestError(f"the {where} are empty: 0 prompt tokens", where)
    if limit is None:
        return None
    name, new = requested_new_tokens(path, body, limits)
    if name is None and prompt_tokens < limit:  # OpenAI's default: what the context leaves
        return min(new, limit - prompt_tokens) if prompt_tokens + new > limit else None
    if prompt_tokens + new > limit:
        asked = f" ({prompt_tokens} in the {where}, {new} for the completion)"
        raise RequestError(
            f"This model's maximum context length is {limit} tokens, however you requested {prompt_tokens + new} "
            f"tokens{asked}. Please reduce the length of the {where} or of the completion"
            + (f" ({name})" if name else "")
            + ".",
            name or where,
            "context_length_exceeded",
        )
    return None


Send = Callable[[dict[str, Any]], Awaitable[None]]


class FrontDoor:
    """ASGI middleware in front of transformers' app (see the module's docstring): API key, closed admin
    routes, a bound on requests in flight (429), request checks (400) and the stream's ``[DONE]``.

    ``FrontDoor(app, limits=, count_prompt=, api_key=None, admin=False, max_requests=256, seeds=None)``:
    ``count_prompt(path, body)`` returns the prompt's tokens as transformers will render them (awaited;
    its exception is a 400 naming the prompt: the chat template refused the messages); ``limits`` a
    :class:`Limits` (read as each request comes); ``seeds`` a ``random.Random`` that draws the seed of each
    request that sends none, one after another (default: the system's random source). A request admitted reaches the app as
    :func:`admitted_body` writes it. :attr:`http` counts answers by ``(path, status)``,
    :attr:`in_flight` the generation requests admitted and not answered yet."""

    def __init__(
        self,
        app: Any,
        *,
        limits: Limits,
        count_prompt: Callable[[str, dict[str, Any]], Awaitable[int]],
        api_key: str | None = None,
        admin: bool = False,
        max_requests: int = 256,
        seeds: random.Random | None = None,
    ) -> None:
        self.app, self.limits, self.count_prompt = app, limits, count_prompt
        self.seeds = seeds if seeds is not None else random.SystemRandom()
        self.api_key, self.admin, self.max_requests = api_key, admin, max_requests
        self.http: dict[tuple[str, int], int] = {}
        self.in_flight = 0
        self.refused_busy = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, status = scope["path"], [499]  # 499: the client left before an answer

        async def counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, counted)
        finally:
            key = (path if path in self._known else "other", status[0])
            self.http[key] = self.http.get(key, 0) + 1

    _known = frozenset({*GENERATION_ROUTES, *ADMIN_ROUTES, *OPEN_ROUTES, "/v1/models", "/metrics"})

    async def _handle(self, scope: Any, receive: Any, send: Send) -> None:
        path = scope["path"]
        if self.api_key is not None and path not in OPEN_ROUTES and not self._authorized(scope):
            error = RequestError(
                "Incorrect or missing API key: send 'Authorization: Bearer <key>' (the server's --api-key)",
                None,
                "invalid_api_key",
                status=401,
            )
            await _answer(error, scope, receive, send, {"www-authenticate": "Bearer"})
            return
        if path in ADMIN_ROUTES and not self.admin:
            error = RequestError(f"{path} is closed: start the server with --admin to open it", None, status=404)
            await _answer(error, scope, receive, send)
            return
        if scope["method"] != "POST" or path not in GENERATION_ROUTES:
            await self.app(scope, receive, send)
            return
        messages = await _read_body(receive)  # a client that sends its body slowly holds no request slot
        if messages[-1]["type"] == "http.disconnect":
            return  # the client left before its request was read
        if self.in_flight >= self.max_requests:
            self.refused_busy += 1
            error = RequestError(
                f"The server is busy: {self.in_flight} requests in flight or queued, at most {self.max_requests} "
                "(--max-concurrent-requests); retry later",
                None,
                "server_busy",
                status=429,
            )
            await _answer(error, scope, receive, send, {"retry-after": "1"})
            return
        self.in_flight += 1
        try:
            await self._generate(scope, messages, receive, send)
        finally:
            self.in_flight -= 1

    def _authorized(self, scope: Any) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), self.api_key or "")
        return False

    async def _generate(self, scope: Any, messages: list[dict[str, Any]], receive: Any, send: Send) -> None:
        path = scope["path"]
        raw = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if isinstance(body, dict):
            try:
                set_tokens = await self._admit(path, body)
            except RequestError as error:
                await _answer(error, scope, receive, send)
                return
            if set_tokens is not None:  # the default, cut to what the context leaves
                body[GENERATION_ROUTES[path][-1]] = set_tokens
            seed = body["seed"] if body.get("seed") is not None else self.seeds.getrandbits(63)
            body = admitted_body(body, seed)
            raw = json.dumps(body).encode()
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(raw)).encode())]}
            messages = [{"type": "http.request", "body": raw, "more_body": False}]
            if body.get("stream") and path != "/v1/responses":
                send = _ending_with_done(send)

        async def replay() -> Any:  # the request read above, then the client's next messages (a disconnect)
            return messages.pop(0) if messages else await receive()

        started = [False]

        async def watched(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                started[0] = True
            await send(message)

        try:
            await self.app(scope, replay, watched)
        except asyncio.CancelledError:  # the server stops (SIGTERM) and its grace (--shutdown-timeout) ran out
            logger.warning("graphrunner serve: %s cancelled: the server stops", path)
            await _end_cancelled(scope, receive, send, started[0])
        except Exception as exc:  # the engine failed the request (asyncio.CancelledError is no Exception)
            if started[0]:
                raise
            logger.error("graphrunner serve: %s failed in the engine: %s", path, exc)
            error = RequestError(f"The engine failed the request: {exc}", None, "engine_error", status=500)
            await _answer(error, scope, receive, send)

    async def _admit(self, path: str, body: dict[str, Any]) -> int | None:
        check_request(path, body, self.limits)
        try:
            tokens = await self.count_prompt(path, body)
        except RequestError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the chat template (or the tokenizer) refused the messages
            where = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}.get(path, "input")
            raise RequestError(f"the {where} could not be rendered for the model: {exc}", where) from None
        return check_length(path, body, tokens, self.limits)


async def _read_body(receive: Any) -> list[dict[str, Any]]:
    """A request's messages up to its whole body (or the client's disconnect: the last message then)."""
    messages = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            return messages


async def _end_cancelled(scope: Any, receive: Any, send: Send, started: bool) -> None:
    """End a request the stopping server cancelled, with no traceback: a stream gets an error event and its end
    (``data: [DONE]`` after it), a request not answered yet a 503. The client may be gone: nothing is raised."""
    try:
        if started:
            error = {"error": {"message": "The server stopped (SIGTERM)", "type": "server_stopping", "code": 503}}
            event = f"data: {json.dumps(error)}\n\n".encode()
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            stopped = RequestError(
                "The server stopped (SIGTERM); retry on another", None, "server_stopping", status=503
            )
            await _answer(stopped, scope, receive, send)
    except Exception as exc:  # noqa: BLE001 - the client or the transport is gone: nothing left to tell it
        logger.info("graphrunner serve: the end of a cancelled request was not sent: %s", exc)


def _ending_with_done(send: Send) -> Send:
    """``send`` for an SSE stream that ends with ``data: [DONE]`` (OpenAI's last event) when it ends."""
    started_sse = [False]

    async def send_done_last(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", []))
            started_sse[0] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and started_sse[0] and not message.get("more_body", False):
            if message.get("body"):
                await send({"type": "http.response.body", "body": message["body"], "more_body": True})
            message = {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
        await send(message)

    return send_done_last


async def _answer(error: RequestError, scope: Any, receive: Any, send: Send, headers: dict | None = None) -> None:
    from starlette.responses import JSONResponse

    await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)
