"""``graphrunner loadtest``: a sustained serving sweep through GraphRunner, checked against an eager engine.

For each concurrency level ``C`` the same seeded stream of requests (per-request prompt and
output lengths) is served twice by a small continuous-batching engine over the demo decoder:

1. through graphs: a :class:`~graphrunner.GraphRunner` with the chosen backend, one decode graph
   per batch bucket;
2. through an eager engine with the same scheduling decisions: a ``GraphRunner`` with the eager
   backend (same static buffers, same padding to the same bucket, no graph), so the two engines
   compute on identical batches and every generated token must be equal, bit for bit.

The engine (:class:`Engine`) admits requests up to ``max_running = C`` (lowest free KV-cache
slot first), prefills each admitted request eagerly (one request at a time), then runs one
batched greedy decode step over every running request per iteration; a request leaves when it
has generated its output length, and its slot is reused. The KV cache has one extra row, the
padding slot: padding rows of a bucket (and the capture warmups) write there only, so they
never touch a real request's cache row.

With ``ranks > 1`` the ranks are real processes, started by torch's elastic launcher
(:func:`graphrunner_tools.launch.launch_ranks`), or, when this process is a torchrun worker
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set:
:func:`~graphrunner_tools.launch.torchrun_env`), torchrun's own ranks, on one node or several:
each runs its part and the ranks exchange their results
(:func:`~graphrunner_tools.launch.run_joined`), so every rank returns the same
:class:`LoadtestResult` and rank 0 prints it. gloo on the CPU tape; on CUDA one process per GPU
joined by NCCL, whose collectives a CUDA graph can capture (gloo's cannot: it copies CUDA tensors through the host). With fewer GPUs than ranks
the run is refused before any process starts (:func:`rank_backend`). Each rank holds a tensor-parallel shard of the decoder (:func:`graphrunner_tools.models.tp.shard_tensor_parallel`:
MLP and attention output, an ``all_reduce`` inside the captured step), serves the same
requests, and the runners' ``group=`` makes the ranks agree on the bucket at every step.
Generated tokens are compared graph vs eager on every rank, and across ranks.

Data parallel (``dp=D``, ``--dp D --tp T``: ``D * T`` processes; DP attention as in the
seed's TP8/DP8 decode). Rank ``r`` is tensor-parallel rank ``r % T`` of data-parallel group
``r // T``. A seeded scheduler (:func:`dp_schedule`) splits the requests over the DP groups
unevenly (group ``g`` draws weight ``2**g``) and gives each an arrival step, so at the same
step the groups run different batch sizes, and some none. Attention output is split over the
group's ``T`` ranks; the MLP spans all ``D * T`` ranks the way an MoE layer does
(:class:`DataParallelMLP`: the step all-gathers every rank's rows, each rank computes its
``1/(D*T)`` slice of the intermediate features for all of them, an ``all_reduce`` sums the
slices and each rank keeps its own rows), so every rank must run every step: an idle rank calls
the runner with 0 rows and joins its peers' padded step (``docs/multirank.md``, "Idle ranks").
The engines step in lockstep (one ``all_max`` per step says whether any rank has work left,
as vLLM's DP coordinator does), and ``--concurrency`` is per DP rank. Tokens are compared graph
vs eager on every rank and across the ``T`` ranks of a group.

A level is clean when every request completed on every rank through both engines, with no
fault (an exception on any rank, a rank timeout, NaN/inf logits) and no mismatch.

Verify tiers (``spec=K``, ``--spec K``, off by default). Every engine step, each running
request proposes ``1..K`` draft tokens (:class:`Drafter`: seeded per request and output
length, some equal to the model's greedy token so some are accepted), and the step is one
speculative verify step (:func:`graphrunner_tools.spec.verify_step_fn` over the decoder's
``verify_step``) served by a runner keyed by ``(reqs, draft)`` (:func:`verify_runner`) instead
of the decode runner; greedy acceptance (:func:`graphrunner_tools.spec.accept`) keeps the drafts the
model agrees with plus the bonus token. The eager engine makes the same draft and acceptance
decisions. Padding: padded request rows use the padding slot; padded cells (beyond a request's
drafts, or of a padded row) write only the scratch position ``max_seq_len - 1``, which
:func:`build_decoder` keeps above every real position (the engine checks it), so they never
touch a real request. The schedule then depends on the accepted tokens too: identical tokens
give identical schedules.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_REQUESTS",
    "FAULTS",
    "LEVEL_KEYS",
    "Engine",
    "DataParallelMLP",
    "dp_schedule",
    "build_decoder",
    "decode_runner",
    "verify_runner",
    "Drafter",
    "run_requests",
    "EngineRun",
    "LevelResult",
    "LoadtestConfig",
    "LoadtestResult",
    "NonFiniteLogitsError",
    "Request",
    "make_requests",
    "report",
    "run_loadtest",
    "serve_levels",
    "serve_rank",
    "add_loadtest_subparser",
]

#: Default concurrency levels and requests per level (finishes in well under 2 minutes on 2 CPU cores).
DEFAULT_CONCURRENCY = (4, 16, 64)
DEFAULT_REQUESTS = 200
#: Planted, test-only faults (``--inject-fault``).
FAULTS = ("mismatch", "stall")
#: The decode step (0-based, of the first level's graph run) at which a planted fault fires.
FAULT_STEP = 2
#: The keys of each entry of the JSON file's ``levels``, in order. ``tier_replays`` maps each
#: replayed key of the graph engine (a batch bucket ``"B"``, or a verify tier ``"RxD"``) to its replays;
#: ``idle_rank_steps`` counts, over every rank, the graph engine's steps run with 0 rows (data parallel);
#: ``schedule`` is rank 0's graph-engine batch size per step (``graphrunner plan`` reads it);
#: ``first_decode_s`` (first level only) rank 0's seconds from the start of the graph runner's capture
#: to its first decode step served (blocking capture, or ``--background-capture``).
LEVEL_KEYS = (
    "concurrency",
    "requests",
    "completed",
    "faults",
    "mismatches",
    "generated_tokens",
    "tokens_per_s",
    "eager_tokens_per_s",
    "replays",
    "fallbacks",
    "p50_step_ms",
    "p99_step_ms",
    "tier_replays",
    "idle_rank_steps",
    "schedule",
    "first_decode_s",
)
#: Probability that a draft token is the model's greedy token (otherwise a random one).
DRAFT_HIT = 0.6


class NonFiniteLogitsError(RuntimeError):
    """A step produced NaN or inf logits (a fault of the loadtest)."""


@dataclass(frozen=True)
class Request:
    """One request: ``prompt`` token ids and the number of tokens to generate (``output_len >= 1``)."""

    rid: int
    prompt: tuple[int, ...]
    output_len: int


def make_requests(
    count: int,
    vocab_size: int,
    prompt_len: tuple[int, int] = (4, 32),
    output_len: tuple[int, int] = (2, 32),
    seed: int = 0,
) -> list[Request]:
    """``count`` requests with prompt and output lengths drawn uniformly from the inclusive
    ``(min, max)`` ranges and prompt tokens uniformly from ``[0, vocab_size)``, all from a
    private generator seeded with ``seed``: the same arguments give the same requests on every
    rank and every run. Raises ``ValueError`` for a count < 1 or a range with min < 1 or min > max."""
    if count < 1:
        raise ValueError(f"make_requests: count must be >= 1, got {count}")
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if lo < 1 or lo > hi:
            raise ValueError(f"make_requests: {name} must be (min, max) with 1 <= min <= max, got {(lo, hi)}")
    gen = torch.Generator().manual_seed(int(seed))
    p_lens = torch.randint(prompt_len[0], prompt_len[1] + 1, (count,), generator=gen).tolist()
    o_lens = torch.randint(output_len[0], output_len[1] + 1, (count,), generator=gen).tolist()
    return [
        Request(i, tuple(torch.randint(0, vocab_size, (p,), generator=gen).tolist()), o)
        for i, (p, o) in enumerate(zip(p_lens, o_lens))
    ]


@dataclass
class EngineRun:
    """What one :meth:`Engine.serve` did (filled in as it goes, so a run cut short by an error
    still tells how far it got): ``tokens`` (request id -> generated tokens, for completed
    requests), ``schedule`` (the batch size of every decode step), ``step_s`` (wall seconds of
    every decode step), ``seconds`` (the whole run: prefills and decode steps)."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    schedule: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    first_step_s: float | None = None  # from the start of serve() to the end of its first decode step

    @property
    def generated_tokens(self) -> int:
        """Tokens generated by the completed requests."""
        return sum(len(t) for t in self.tokens.values())


class Drafter:
    """Draft proposals for ``--spec K``: ``drafter(rid, done) -> 1..k`` draft tokens for request
    ``rid`` that has generated ``done`` tokens. Each draft is, with probability
    :data:`DRAFT_HIT`, the token of ``greedy[rid]`` at that place (the model's greedy output,
    e.g. from an eager decode run, so drafts get accepted), otherwise a random token in
    ``[0, vocab_size)``. The draws come from a generator seeded with ``(seed, rid, done)``:
    two engines in the same state propose the same drafts, whatever their schedules."""

    def __init__(self, greedy: dict[int, list[int]], k: int, vocab_size: int, seed: int = 0) -> None:
        if k < 1:
            raise ValueError(f"Drafter: k must be >= 1, got {k}")
        self.greedy, self.k, self.vocab_size, self.seed = greedy, k, vocab_size, int(seed)

    def __call__(self, rid: int, done: int) -> list[int]:
        import random

        rng = random.Random((self.seed * 1_000_003 + rid) * 10_007 + done)
        ref = self.greedy.get(rid, [])
        out = []
        for j in range(rng.randint(1, self.k)):
            i = done + j
            out.append(ref[i] if i < len(ref) and rng.random() < DRAFT_HIT else rng.randrange(self.vocab_size))
        return out


@dataclass
class _Running:
    req: Request
    slot: int
    pos: int  # position of the next input token
    out: list[int]


class Engine:
    """A greedy continuous-batching engine over a :class:`~graphrunner_tools.models.LlamaForCausalLM`.

    Args:
        model: the decoder; its KV cache needs ``max_running + 1`` rows at least and
            ``max_seq_len >= max(prompt + output) - 1``.
        decode: ``decode(input_ids=[n], positions=[n], slot_ids=[n]) -> logits [n, vocab]``,
            e.g. :func:`decode_runner` (a ``GraphRunner`` whose padding rows use the padding slot).
        max_running: the most requests decoded together (admission stops there). Requests get
            the cache rows (slots) ``0 .. max_running - 1``, lowest free first; the rows from
            ``max_running`` on are never given to a request (the padding slot lives there).
        after_decode: optional ``hook(step, logits)`` called after each decode (or verify) step,
            before the tokens are read (the planted ``mismatch`` fault uses it).
        on_progress: optional ``fn(completed, total)`` called after each decode step.
        verify: optional ``verify(tokens=[R, D], positions=[R, D], lens=[R], slots=[R]) ->
            logits [R, D, vocab]``, e.g. :func:`verify_runner`; with it (and ``drafter``) every
            step is a verify step: cell 0 of a row is the request's last token, then its drafts
            (``lens`` = 1 + drafts; the cells beyond are padding, 0 at position 0).
        drafter: ``drafter(rid, done) -> drafts`` (:class:`Drafter`), needed with ``verify``.
        hold: optional ``hold() -> context manager`` around the engine's own writes of the model's
            state outside the runner's calls (each prefill): ``GraphRunner.hold`` of a runner whose
            capture may run in the background (``capture(background=True)``).

    Without ``verify`` the schedule depends on the requests' lengths only (never on the
    generated tokens), so two engines serving the same requests with the same ``max_running``
    make the same scheduling decisions, step for step. With ``verify`` it also depends on the
    accepted tokens: engines that generate the same tokens make the same decisions.
    """

    def __init__(
        self,
        model: Any,
        decode: Callable[..., torch.Tensor] | None,
        max_running: int,
        after_decode: Callable[[int, torch.Tensor], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        verify: Callable[..., torch.Tensor] | None = None,
        drafter: Callable[[int, int], list[int]] | None = None,
        hold: Callable[[], Any] | None = None,
    ) -> None:
        rows = model.config.max_batch_size
        if max_running < 1 or max_running >= rows:
            raise ValueError(
                f"Engine: max_running must be in [1, {rows - 1}]: the KV cache has {rows} rows and "
                "one beyond the requests' slots is the padding slot; build the model with "
                "LlamaConfig(max_batch_size=max_running + 1) or more"
            )
        if (verify is None) != (drafter is None) or (verify is None and decode is None):
            raise ValueError("Engine: pass decode, or verify together with drafter")
        self.model = model
        self.decode = decode
        self.verify = verify
        self.drafter = drafter
        self.max_running = max_running
        self.after_decode = after_decode
        self.on_progress = on_progress
        self.hold = hold or contextlib.nullcontext
        self.device = next(model.parameters()).device
        self.last = EngineRun()

    def serve(
        self,
        requests: Sequence[Request],
        arrival: Sequence[int] | None = None,
        sync: Callable[[bool, int], bool] | None = None,
    ) -> EngineRun:
        """Serve every request to completion; return the :class:`EngineRun` (also ``self.last``).

        Data parallel: ``arrival[i]`` is the step from which ``requests[i]`` may be admitted, and
        ``sync(has_work, step) -> any rank has work`` makes the engine step in lockstep with its
        peers: a step with nothing running calls the runner with 0 rows (an idle rank), and the
        run ends when no rank has work. Raises :class:`NonFiniteLogitsError` on NaN/inf logits,
        and whatever ``decode`` raises (e.g. :class:`~graphrunner.errors.RankTimeoutError`)."""
        if sync is not None:
            return self._serve_lockstep(requests, arrival or [0] * len(requests), sync)
        run = self.last = EngineRun()
        if self.verify is not None:
            self._check_scratch(requests)
        t_start = time.perf_counter()
        pending = list(reversed(requests))
        free = list(range(self.max_running))  # a heap: the lowest free slot first
        running: list[_Running] = []
        step = 0
        with torch.inference_mode():
            while pending or running:
                while pending and len(running) < self.max_running:
                    self._start(pending.pop(), run, free, running)
                if not running:
                    continue
                running = self._step(step, running, run, free, len(requests), t_start)
                step += 1
        run.seconds = time.perf_counter() - t_start
        return run

    def _serve_lockstep(
        self, requests: Sequence[Request], arrival: Sequence[int], sync: Callable[[bool, int], bool]
    ) -> EngineRun:
        run = self.last = EngineRun()
        if self.verify is not None:
            self._check_scratch(requests)
        t_start = time.perf_counter()
        pending = sorted(zip(arrival, range(len(requests))), reverse=True)  # pop(): the earliest first
        free = list(range(self.max_running))
        running: list[_Running] = []
        step = 0
        with torch.inference_mode():
            while sync(bool(pending or running), step):
                while pending and pending[-1][0] <= step and len(running) < self.max_running:
                    self._start(requests[pending.pop()[1]], run, free, running)
                running = self._step(step, running, run, free, len(requests), t_start)
                step += 1
        run.seconds = time.perf_counter() - t_start
        return run

    def _start(self, req: Request, run: EngineRun, free: list[int], running: list[_Running]) -> None:
        """Admit ``req`` into the lowest free slot; finished at once (output length 1) or appended to ``running``."""
        r = self._admit(req, heapq.heappop(free))
        if len(r.out) >= r.req.output_len:
            self._finish(r, run, free)
        else:
            running.append(r)

    def _step(
        self, step: int, running: list[_Running], run: EngineRun, free: list[int], total: int, t_start: float
    ) -> list[_Running]:
        """One engine step over ``running`` (decode, or verify with ``--spec``): record its time, extend each
        request's output, finish the complete ones; returns the requests still running."""
        t0 = time.perf_counter()
        if self.verify is not None:
            tokens = self._verify_step(step, running)
        else:
            tokens = [[t] for t in self._decode_step(step, running)]
        run.step_s.append(time.perf_counter() - t0)
        run.schedule.append(len(running))
        if run.first_step_s is None:
            run.first_step_s = time.perf_counter() - t_start
        still = []
        for r, toks in zip(running, tokens):
            r.out.extend(toks[: r.req.output_len - len(r.out)])
            r.pos += len(toks)
            if len(r.out) >= r.req.output_len:
                self._finish(r, run, free)
            else:
                still.append(r)
        if self.on_progress is not None:
            self.on_progress(len(run.tokens), total)
        run.seconds = time.perf_counter() - t_start
        return still

    def _admit(self, req: Request, slot: int) -> _Running:
        """Prefill ``req`` into cache row ``slot`` (eager) and take its first token."""
        ids = torch.tensor([req.prompt], dtype=torch.long, device=self.device)
        slots = torch.tensor([slot], dtype=torch.long, device=self.device)
        with self.hold():  # a background capture puts back what it wrote: not while the prefill writes
            logits = self.model.prefill(ids, slot_ids=slots)[:, -1]
        return _Running(req, slot, len(req.prompt), self._tokens(logits, "prefill"))

    def _decode_plan(self, running: Sequence[_Running]) -> dict[str, torch.Tensor]:
        """The inputs of one decode step: each running request's last token, position and slot."""
        dev = self.device
        return {
            "input_ids": torch.tensor([r.out[-1] for r in running], dtype=torch.long, device=dev),
            "positions": torch.tensor([r.pos for r in running], dtype=torch.long, device=dev),
            "slot_ids": torch.tensor([r.slot for r in running], dtype=torch.long, device=dev),
        }

    def _decode_step(self, step: int, running: Sequence[_Running]) -> list[int]:
        logits = self.decode(**self._decode_plan(running))
        if self.after_decode is not None:
            self.after_decode(step, logits)
        return self._tokens(logits, f"decode step {step}")

    def _check_scratch(self, requests: Sequence[Request]) -> None:
        """Verify steps write padded cells at the scratch position ``max_seq_len - 1``: it must
        lie above every position a real cell uses (last token + ``k`` drafts)."""
        k = getattr(self.drafter, "k", None)
        if k is None:
            return
        scratch = self.model.config.max_seq_len - 1
        top = max(len(r.prompt) + r.output_len - 2 + k for r in requests)
        if top >= scratch:
            raise ValueError(
                f"Engine: a verify cell may use position {top}, but position {scratch} "
                f"(max_seq_len - 1) is the padding cells' scratch position; build the model "
                f"with max_seq_len >= {top + 2} (longest prompt + output + k)"
            )

    def _verify_plan(self, running: Sequence[_Running], drafts: list[list[int]]) -> dict[str, torch.Tensor]:
        """The inputs of one verify step: ``[R, 1 + max drafts]`` cells (last token, then the
        drafts, at consecutive positions; 0 at position 0 beyond), ``lens`` and ``slots``."""
        dev = self.device
        if not running:  # an idle data-parallel rank: 0 requests and 0 cells
            empty = torch.zeros((0, 0), dtype=torch.long, device=dev)
            return {
                "tokens": empty,
                "positions": empty.clone(),
                "lens": torch.zeros(0, dtype=torch.long, device=dev),
                "slots": torch.zeros(0, dtype=torch.long, device=dev),
            }
        width = 1 + max(len(d) for d in drafts)
        tokens = [[r.out[-1]] + d + [0] * (width - 1 - len(d)) for r, d in zip(running, drafts)]
        positions = [
            list(range(r.pos, r.pos + 1 + len(d))) + [0] * (width - 1 - len(d)) for r, d in zip(running, drafts)
        ]
        dev = self.device
        return {
            "tokens": torch.tensor(tokens, dtype=torch.long, device=dev),
            "positions": torch.tensor(positions, dtype=torch.long, device=dev),
            "lens": torch.tensor([1 + len(d) for d in drafts], dtype=torch.long, device=dev),
            "slots": torch.tensor([r.slot for r in running], dtype=torch.long, device=dev),
        }

    def _verify_step(self, step: int, running: Sequence[_Running]) -> list[list[int]]:
        from graphrunner_tools.spec import accept

        assert self.verify is not None and self.drafter is not None
        drafts = [self.drafter(r.req.rid, len(r.out)) for r in running]
        logits = self.verify(**self._verify_plan(running, drafts))
        if self.after_decode is not None:
            self.after_decode(step, logits)
        for i, d in enumerate(drafts):
            if not bool(torch.isfinite(logits[i, : 1 + len(d)]).all()):
                raise NonFiniteLogitsError(f"verify step {step} produced NaN/inf logits")
        return [accept(logits[i], d) for i, d in enumerate(drafts)]

    def _tokens(self, logits: torch.Tensor, where: str) -> list[int]:
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogitsError(f"{where} produced NaN/inf logits")
        return logits.argmax(-1).tolist()

    def _finish(self, r: _Running, run: EngineRun, free: list[int]) -> None:
        run.tokens[r.req.rid] = r.out
        heapq.heappush(free, r.slot)


# --------------------------------------------------------------------------- configuration and results
@dataclass(frozen=True)
class LoadtestConfig:
    """Everything a loadtest run needs (picklable: it is sent to every rank).

    ``concurrency``: the levels; ``requests``: served per level; ``backend``: ``"full"``
    (masked attention, one graph per bucket) or ``"breakable"`` (attention as an eager break);
    ``timeout``: the rank group's timeout in seconds (``TorchDistGroup(timeout=)``: bucket
    agreement and the collectives inside the step); ``inject_fault``: ``None`` or one of
    :data:`FAULTS` (test-only); ``prompt_len``/``output_len``: inclusive ranges; ``spec``: 0
    (decode steps, default) or ``K >= 1``: verify steps with ``1..K`` drafts per request
    (module docstring); ``dp``: data-parallel groups (``ranks = dp * tp``, module docstring;
    1: every rank serves the same requests, tensor parallel).
    """

    ranks: int = 1
    requests: int = DEFAULT_REQUESTS
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    backend: str = "breakable"
    device: str = "auto"
    layers: int = 2
    seed: int = 0
    prompt_len: tuple[int, int] = (4, 32)
    output_len: tuple[int, int] = (2, 32)
    timeout: float = 30.0
    inject_fault: str | None = None
    threads: int = 1
    progress: bool = True
    spec: int = 0
    dp: int = 1
    background_capture: bool = False

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks per data-parallel group."""
        return self.ranks // self.dp

    def __post_init__(self) -> None:
        if self.dp < 1 or self.ranks % self.dp:
            raise ValueError(
                f"dp must be >= 1 and divide ranks (ranks = dp * tp), got dp={self.dp}, ranks={self.ranks}"
            )
        if self.spec < 0:
            raise ValueError(f"spec must be 0 (off) or K >= 1 drafts per request, got {self.spec}")
        if self.backend not in ("full", "breakable"):
            raise ValueError(f"backend must be 'full' or 'breakable', got {self.backend!r}")
        if self.inject_fault not in (None,) + FAULTS:
            raise ValueError(f"inject_fault must be None or one of {FAULTS}, got {self.inject_fault!r}")
        if self.inject_fault == "stall" and self.ranks < 2:
            raise ValueError("inject_fault='stall' stalls one rank while the others wait: it needs ranks >= 2")
        if self.ranks < 1 or self.requests < 1 or not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("ranks, requests and every concurrency level must be >= 1")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")


@dataclass
class LevelResult:
    """One concurrency level. The first sixteen fields are the JSON entry (:data:`LEVEL_KEYS`);
    ``eager_p50_step_ms``/``eager_p99_step_ms`` are the eager engine's step times (for
    ``graphrunner bench``), ``errors`` what failed (per rank), ``mismatched`` the ids of the
    requests whose tokens differed, ``tokens`` rank 0's graph-engine tokens per request id. Rates and step times are rank 0's (``None`` when not run)."""

    concurrency: int
    requests: int
    completed: int = 0
    faults: int = 0
    mismatches: int = 0
    generated_tokens: int = 0
    tokens_per_s: float | None = None
    eager_tokens_per_s: float | None = None
    replays: int = 0
    fallbacks: int = 0
    p50_step_ms: float | None = None
    p99_step_ms: float | None = None
    tier_replays: dict[str, int] = field(default_factory=dict)
    idle_rank_steps: int = 0
    schedule: list[int] = field(default_factory=list)
    first_decode_s: float | None = None
    eager_p50_step_ms: float | None = None
    eager_p99_step_ms: float | None = None
    errors: list[str] = field(default_factory=list)
    mismatched: list[int] = field(default_factory=list)
    tokens: dict[int, list[int]] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        """Every request completed, no fault, no mismatch."""
        return self.completed == self.requests and self.faults == 0 and self.mismatches == 0

    def to_json(self) -> dict[str, Any]:
        """The level's entry of the JSON file: exactly :data:`LEVEL_KEYS`."""
        d = asdict(self)
        return {k: d[k] for k in LEVEL_KEYS}

    def line(self) -> str:
        """``C16: 400/400 requests, 0 faults, 0 mismatches, 1,234 tok/s (eager 987 tok/s, 1.25x)``."""
        head = (
            f"C{self.concurrency}: {self.completed}/{self.requests} requests, {self.faults} faults, "
            f"{self.mismatches} mismatches"
        )
        if self.idle_rank_steps:
            head += f", {self.idle_rank_steps} idle-rank steps"
        if self.first_decode_s is not None:
            head += f", first decode step {self.first_decode_s * 1000:,.0f} ms after the capture began"
        if self.tokens_per_s is None or self.eager_tokens_per_s is None:
            return head + ", not measured"
        return (
            head + f", {self.tokens_per_s:,.0f} tok/s (eager {self.eager_tokens_per_s:,.0f} tok/s, "
            f"{self.tokens_per_s / self.eager_tokens_per_s:.2f}x)"
        )


@dataclass
class LoadtestResult:
    """A whole run: ``levels`` (one :class:`LevelResult` each), ``errors`` not tied to a level
    (capture, a rank that died), ``seconds`` (wall time), ``dist_backend`` (the ranks' process
    group: ``"gloo"`` or ``"nccl"``; ``None`` for one rank). ``rank``: under torchrun, this
    process's rank (every rank returns the combined result; rank 0 prints it and writes the
    JSON), ``None`` otherwise."""

    config: LoadtestConfig
    levels: list[LevelResult]
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    dist_backend: str | None = None
    rank: int | None = None

    @property
    def ok(self) -> bool:
        """True when every level is clean and nothing else failed."""
        return not self.errors and all(lv.ok for lv in self.levels)

    def to_json(self) -> dict[str, Any]:
        """``{"ranks", "dp", "tp", "backend", "dist_backend", "spec", "background_capture", "levels": [...]}``:
        the file ``--json`` writes."""
        return {
            "ranks": self.config.ranks,
            "dp": self.config.dp,
            "tp": self.config.tp,
            "backend": self.config.backend,
            "dist_backend": self.dist_backend,
            "spec": self.config.spec,
            "background_capture": self.config.background_capture,
            "levels": [lv.to_json() for lv in self.levels],
        }


# --------------------------------------------------------------------------- one rank
class _StallOnce:
    """A rank group that, once armed, sleeps ``seconds`` after its ``after``-th ``all_max_vector``:
    inside that runner call, after the key agreement and before the replay (a GraphRunner
    call makes exactly one ``all_max_vector``), so the peers wait in the step's collectives.
    Every other call is passed through unchanged (the same collectives as the peers' groups)."""

    def __init__(self, inner: Any, after: int, seconds: float) -> None:
        self.inner, self.after, self.seconds = inner, after, seconds
        self.rank, self.size = inner.rank, inner.size
        self.timeout = getattr(inner, "timeout", None)
        self.armed = False
        self._count = 0

    def barrier(self, **kw: Any) -> None:
        self.inner.barrier(**kw)

    def all_max(self, value: int, **kw: Any) -> int:
        return self.inner.all_max(value, **kw)

    def all_min(self, value: int, **kw: Any) -> int:
        return self.inner.all_min(value, **kw)

    def all_max_vector(self, values: Any, **kw: Any) -> Any:
        out = self.inner.all_max_vector(values, **kw)
        if self.armed:
            self._count += 1
            if self._count == self.after:
                time.sleep(self.seconds)
        return out


def _buckets(max_running: int) -> list[int]:
    out, b = [], 1
    while b < max_running:
        out.append(b)
        b *= 2
    return out + [max_running]


def _percentile(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    s = sorted(samples)
    return s[max(0, math.ceil(q * len(s)) - 1)] * 1e3


def _summary(run: EngineRun, stats: Any) -> dict[str, Any]:
    return {
        "tokens": run.tokens,
        "schedule": run.schedule,
        "seconds": run.seconds,
        "generated_tokens": run.generated_tokens,
        "p50_step_ms": _percentile(run.step_s, 0.50),
        "p99_step_ms": _percentile(run.step_s, 0.99),
        "replays": sum(stats.replays.values()),
        "fallbacks": stats.fallbacks,
        "tier_replays": {_tier(k): n for k, n in stats.replays.items() if n},
    }


def _tier(key: Any) -> str:
    return "x".join(map(str, key)) if isinstance(key, tuple) else str(key)


class _Progress:
    """Rank 0's progress line on a terminal (nothing when stderr is not a TTY)."""

    def __init__(self, enabled: bool) -> None:
        from graphrunner.progress import StatusLine

        self.status = StatusLine() if enabled else None
        if self.status is not None and not self.status.tty:
            self.status = None
        self.label = ""
        self._last = 0.0

    def update(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.status is not None and (now - self._last > 0.2 or done == total):
            self._last = now
            width = 24
            fill = width * done // max(total, 1)
            self.status.write(f"loadtest {self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} requests")

    def close(self) -> None:
        if self.status is not None:
            self.status.write("")
            self.status.stream.write("\r")
            self.status.stream.flush()


def run_requests(cfg: LoadtestConfig, vocab_size: int) -> list[Request]:
    """The requests every level of a run serves (:func:`make_requests` from ``cfg.seed + 1``)."""
    return make_requests(cfg.requests, vocab_size, cfg.prompt_len, cfg.output_len, cfg.seed + 1)


class DataParallelMLP(torch.nn.Module):
    """The MLP of DP attention, spanning all ``world`` ranks the way an MoE layer does.

    Inside the runner's step (:attr:`gather` set by :func:`_gathering`) it all-gathers every
    rank's rows (the ranks run the same agreed batch size: an idle rank's rows are all
    padding), computes this rank's ``1/world`` slice of the intermediate features for all of
    them, sums the slices over the ranks (``all_reduce``) and keeps its own rows: every token
    gets the whole MLP. Outside the step (the engine's eager prefill, one request at a time on
    each rank) it runs the whole MLP locally, with no collective."""

    def __init__(self, full: torch.nn.Module, rank: int, world: int) -> None:
        import warnings

        from graphrunner_tools.models.tp import ShardedMLP

        # torch 2.9 deprecates the name in favour of all_gather_single (absent from older torch)
        warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
        super().__init__()
        self.full, self.shard = full, ShardedMLP(full, rank, world, None)
        self.rank, self.world, self.gather = rank, world, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gather:
            return self.full(x)
        import torch.distributed as dist

        n = x.shape[0]
        everyone = x.new_empty((self.world * n, *x.shape[1:]))
        dist.all_gather_into_tensor(everyone, x.contiguous())
        return self.shard(everyone)[self.rank * n : (self.rank + 1) * n]


class _gathering:
    """``with _gathering(model):`` the model's :class:`DataParallelMLP` layers gather (the step)."""

    def __init__(self, model: Any) -> None:
        self.layers = getattr(model, "dp_layers", ())

    def __enter__(self) -> None:
        for m in self.layers:
            m.gather = True

    def __exit__(self, *exc: Any) -> None:
        for m in self.layers:
            m.gather = False


def dp_schedule(requests: Sequence[Request], dp: int, seed: int) -> list[tuple[list[Request], list[int]]]:
    """``[(requests, arrival steps)]`` of each data-parallel group: a seeded, uneven split (group
    ``g`` draws weight ``2**g``) and per request a seeded arrival step in ``[0, len(requests) // 4]``,
    so at the same step the groups run different batch sizes, some none."""
    import random

    rng = random.Random(seed * 7919 + dp)
    out: list[tuple[list[Request], list[int]]] = [([], []) for _ in range(dp)]
    spread = max(1, len(requests) // 4)
    for req in requests:
        g = rng.choices(range(dp), weights=[2**i for i in range(dp)])[0]
        out[g][0].append(req)
        out[g][1].append(rng.randrange(spread + 1))
    return out


def build_decoder(cfg: LoadtestConfig, rank: int = 0, world: int = 1, device: Any = "cpu") -> Any:
    """The demo decoder of a run: ``cfg.layers`` layers of the demo size, masked attention for
    the full backend (varlen otherwise), ``max(cfg.concurrency) + 1`` KV-cache rows (the last is
    the padding slot), positions for the longest prompt plus output (plus ``cfg.spec``: the
    drafts, and the verify step's scratch position ``max_seq_len - 1`` above them all),
    weights from ``cfg.seed``; with ``world > 1`` this rank's tensor-parallel shard (with
    ``cfg.dp > 1``: attention output split over the rank's DP group, the MLP a
    :class:`DataParallelMLP` over all ranks; ``model.dp_layers`` lists those)."""
    from graphrunner_tools.models import LlamaConfig, build_model
    from graphrunner_tools.models.tp import shard_tensor_parallel

    config = LlamaConfig.demo(
        num_layers=cfg.layers,
        attention="masked" if cfg.backend == "full" else "varlen",
        max_batch_size=max(cfg.concurrency) + 1,
        max_seq_len=cfg.prompt_len[1] + cfg.output_len[1] + cfg.spec,
    )
    model = build_model(config, seed=cfg.seed, device=device)
    if world > 1 and cfg.dp > 1:
        import torch.distributed as dist

        tp = world // cfg.dp
        groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(cfg.dp)]  # the world's backend
        full = [layer.mlp for layer in model.model.layers]
        if tp > 1:
            shard_tensor_parallel(model, rank % tp, tp, process_group=groups[rank // tp])
        with torch.inference_mode(False), torch.no_grad():
            for layer, mlp in zip(model.model.layers, full):
                layer.mlp = DataParallelMLP(mlp, rank, world)
        model.dp_layers = [layer.mlp for layer in model.model.layers]
    elif world > 1:
        shard_tensor_parallel(model, rank, world)
    return model


def decode_runner(model: Any, backend: Any, max_running: int, pad_slot: int | None = None, **runner_kwargs: Any) -> Any:
    """A :class:`~graphrunner.GraphRunner` over ``model.decode_step(input_ids, positions, slot_ids)``
    with buckets ``1, 2, 4, ..., max_running`` (powers of two, then ``max_running``). Padding
    rows are token 0 at position 0 in cache row ``pad_slot`` (default: ``max_running``, the
    row no request is given), so they never touch a real request's cache row.
    ``runner_kwargs`` go to ``GraphRunner`` (``device=``, ``group=``, ...)."""
    from graphrunner.runner import BatchInput, GraphRunner

    pad_slot = max_running if pad_slot is None else pad_slot
    cfg = model.config
    # bounds: the real values (the padding check draws real cells from them); the pad slot lies outside
    inputs = {
        "input_ids": BatchInput(trailing=(), dtype=torch.long, pad=0, bounds=(0, cfg.vocab_size - 1)),
        "positions": BatchInput(trailing=(), dtype=torch.long, pad=0, bounds=(0, cfg.max_seq_len - 1)),
        "slot_ids": BatchInput(trailing=(), dtype=torch.long, pad=pad_slot, bounds=(0, max_running - 1)),
    }

    def step(input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        if not getattr(model, "dp_layers", None):
            return model.decode_step(input_ids, positions, slot_ids)
        with _gathering(model):  # data parallel: the MLP spans every rank
            return model.decode_step(input_ids, positions, slot_ids)

    return GraphRunner(step, inputs, _buckets(max_running), backend=backend, **runner_kwargs)


def _draft_buckets(k: int) -> list[int]:
    return [b for b in _buckets(k + 1) if b >= 2]


def verify_runner(
    model: Any,
    backend: Any,
    max_running: int,
    k: int,
    pad_slot: int | None = None,
    mask: bool = True,
    **runner_kwargs: Any,
) -> Any:
    """A :class:`~graphrunner.GraphRunner` over :func:`graphrunner_tools.spec.verify_step_fn` of
    ``model`` (``step(tokens, positions, lens, slots) -> logits [reqs, draft, vocab]``), keyed
    by ``(reqs, draft)``: ``reqs`` buckets as :func:`decode_runner`, ``draft`` (cells per
    request: last token + ``1..k`` drafts) buckets ``2, 4, ..., k + 1``. Padded request rows
    use cache row ``pad_slot`` (default ``max_running``, the padding slot) with ``lens`` 0;
    every padded cell writes only the scratch position ``max_seq_len - 1``. ``mask=False``
    drops that masking (negative control only: padded cells overwrite position 0 of real
    requests). ``runner_kwargs`` go to ``GraphRunner``."""
    from graphrunner.runner import BatchInput, GraphRunner
    from graphrunner_tools.spec import verify_step_fn

    pad_slot = max_running if pad_slot is None else pad_slot
    dims = ("reqs", "draft")
    inputs = {
        "tokens": BatchInput(dtype=torch.long, pad=0, dims=dims),
        "positions": BatchInput(dtype=torch.long, pad=0, dims=dims),
        "lens": BatchInput(dtype=torch.long, pad=0, dims=("reqs",)),
        "slots": BatchInput(dtype=torch.long, pad=pad_slot, dims=("reqs",)),
    }
    # The padding check does not apply: the real cells of a verify step are ragged (``lens`` per
    # request), and padded cells share one scratch position, so no bounds describe them; the
    # loadtest compares every token with the eager engine instead.
    runner_kwargs.setdefault("checks", ("drift", "fingerprint"))
    fn = verify_step_fn(model, mask=mask)
    if getattr(model, "dp_layers", None):
        inner = fn

        def fn(tokens: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor) -> Any:
            with _gathering(model):  # data parallel: the MLP spans every rank
                return inner(tokens=tokens, positions=positions, lens=lens, slots=slots)

    return GraphRunner(
        fn,
        inputs,
        {"reqs": _buckets(max_running), "draft": _draft_buckets(k)},
        outputs=dims,
        backend=backend,
        **runner_kwargs,
    )


def serve_levels(rank: int, world: int, cfg: LoadtestConfig) -> dict[str, Any]:
    """One rank's whole run (torch.distributed initialised; a rank of :func:`~graphrunner_tools.launch.launch_ranks`
    or of torchrun): :func:`serve_rank`, and on a fault raise
    :class:`~graphrunner_tools.launch.PartialResult` carrying its result, so the launcher reports
    the rank as failed and leaves its (maybe unusable) process group alone."""
    from graphrunner_tools.launch import PartialResult

    res = serve_rank(rank, world, cfg)
    failed = res["error"] or next((lv["error"] for lv in res["levels"] if lv.get("error")), None)
    if failed:
        raise PartialResult(res, failed)
    return res


def serve_rank(rank: int, world: int, cfg: LoadtestConfig) -> dict[str, Any]:
    """One rank's whole run: build (and shard) the decoder, capture both runners, serve every
    level through graphs then eager. Returns ``{"levels": [...], "error": str|None}``; an
    exception stops the run (after it the process group may be unusable) and is reported in
    the level it hit (or in ``error`` before the first level)."""
    from graphrunner.devices import get_device
    from graphrunner.group import LocalGroup, TorchDistGroup

    levels: list[dict[str, Any]] = []
    progress = _Progress(cfg.progress and rank == 0)
    try:
        dev = get_device(cfg.device)
        max_c = max(cfg.concurrency)
        model = build_decoder(cfg, rank, world, dev.torch_device)
        group: Any = LocalGroup() if world == 1 else TorchDistGroup(timeout=cfg.timeout)
        stall = None
        if cfg.inject_fault == "stall" and rank == world - 1:
            group = stall = _StallOnce(group, after=FAULT_STEP + 1, seconds=2 * cfg.timeout + 1)
        if cfg.spec:
            runners = {
                kind: verify_runner(model, backend, max_c, cfg.spec, device=dev, group=group, progress=False)
                for kind, backend in (("graph", cfg.backend), ("eager", "eager"))
            }
        else:
            runners = {
                kind: decode_runner(model, backend, max_c, device=dev, group=group, progress=False)
                for kind, backend in (("graph", cfg.backend), ("eager", "eager"))
            }
        t_capture = time.perf_counter()
        runners["eager"].capture()
        runners["graph"].capture(background=cfg.background_capture)  # background: serving starts at once
        requests = run_requests(cfg, model.config.vocab_size)
        serve_kw: dict[str, Any] = {}
        if cfg.dp > 1:  # this rank's DP group's share, in lockstep with every rank
            requests, arrival = dp_schedule(requests, cfg.dp, cfg.seed)[rank // cfg.tp]
            steps = TorchDistGroup(timeout=cfg.timeout)
            serve_kw = {
                "arrival": arrival,
                "sync": lambda more, step: bool(steps.all_max(int(more), phase="dp_step", key=step)),
            }
        drafter = None
        if cfg.spec:
            # the drafts' greedy tokens: one eager decode run (every rank runs it: the TP collectives)
            greedy = decode_runner(model, "eager", max_c, device=dev, group=group, progress=False)
            greedy.capture()
            model.reset_cache()
            progress.label = "drafts (eager decode)"
            with torch.inference_mode():
                oracle = Engine(model, greedy, max_c, on_progress=progress.update).serve(requests, **serve_kw).tokens
            drafter = Drafter(oracle, cfg.spec, model.config.vocab_size, cfg.seed + 2)
    except Exception as exc:  # noqa: BLE001 - reported as this rank's fault
        progress.close()
        return {"levels": levels, "error": f"rank {rank}: {type(exc).__name__}: {exc}"}

    def perturb(step_i: int, logits: torch.Tensor) -> None:
        # planted fault: flip one replayed output row (argmax becomes argmin)
        if step_i == FAULT_STEP and runners["graph"].stats.last_bucket is not None and logits.shape[0]:
            logits[0].neg_()

    try:
        for i, c in enumerate(cfg.concurrency):
            level: dict[str, Any] = {"concurrency": c, "error": None}
            levels.append(level)
            for kind in ("graph", "eager"):
                runner = runners[kind]
                first_graph = i == 0 and kind == "graph"
                hook = perturb if (first_graph and cfg.inject_fault == "mismatch" and rank == 0) else None
                if stall is not None:
                    stall.armed = first_graph
                progress.label = f"C{c} {kind}"
                runner.stats.reset()
                with runners["graph"].hold():
                    model.reset_cache()
                if drafter is not None:
                    engine = Engine(
                        model,
                        None,
                        c,
                        after_decode=hook,
                        on_progress=progress.update,
                        verify=runner,
                        drafter=drafter,
                        hold=runners["graph"].hold,
                    )
                else:
                    engine = Engine(
                        model, runner, c, after_decode=hook, on_progress=progress.update, hold=runners["graph"].hold
                    )
                started = time.perf_counter() - t_capture
                try:
                    engine.serve(requests, **serve_kw)
                finally:
                    level[kind] = _summary(engine.last, runner.stats)
                if first_graph and engine.last.first_step_s is not None:
                    level[kind]["first_decode_s"] = started + engine.last.first_step_s
    except Exception as exc:  # noqa: BLE001 - a fault: stop here, the group may be unusable
        levels[-1]["error"] = f"rank {rank}: {type(exc).__name__}: {exc}"
    finally:
        progress.close()
    return {"levels": levels, "error": None}


# --------------------------------------------------------------------------- combining the ranks
def _combine(cfg: LoadtestConfig, per_rank: list[dict[str, Any] | None], rank_errors: list[str]) -> LoadtestResult:
    """Build the levels from every rank's :func:`serve_levels` result (``None``: the rank
    never reported; ``rank_errors`` says why). Tokens and schedules are compared within each
    data-parallel group (all ranks when ``cfg.dp == 1``): graph vs eager, and across its ranks."""
    errors = [r["error"] for r in per_rank if r is not None and r.get("error")]  # before the first level
    levels: list[LevelResult] = []
    tp = max(1, len(per_rank) // cfg.dp)
    for i, c in enumerate(cfg.concurrency):
        lv = LevelResult(concurrency=c, requests=cfg.requests)
        ranks = [r["levels"][i] if r is not None and i < len(r["levels"]) else None for r in per_rank]
        lv.errors = [x["error"] for x in ranks if x is not None and x.get("error")]
        lv.faults = len(lv.errors)
        done = [x for x in ranks if x is not None and "graph" in x and "eager" in x]
        if len(done) == len(ranks):
            g_tokens = e_tokens = 0
            for g in range(cfg.dp):
                group = done[g * tp : (g + 1) * tp]
                complete = None
                for x in group:
                    ids = set(x["graph"]["tokens"]) & set(x["eager"]["tokens"])
                    complete = ids if complete is None else complete & ids
                complete = complete or set()
                lv.completed += len(complete)
                ref = group[0]["graph"]["tokens"]
                bad = set()
                for x in group:
                    gt, et = x["graph"]["tokens"], x["eager"]["tokens"]
                    bad |= {rid for rid in complete if gt[rid] != et[rid] or gt[rid] != ref[rid]}
                for x in group:
                    # verify steps: the schedule follows the accepted tokens, so a token mismatch
                    # may change it; with equal tokens a different schedule is an engine bug
                    if (not cfg.spec or not bad) and (
                        x["graph"]["schedule"] != x["eager"]["schedule"]
                        or x["graph"]["schedule"] != group[0]["graph"]["schedule"]
                    ):
                        lv.errors.append(f"C{c}: the engines' schedules differ (engine bug)")
                        lv.faults += 1
                lv.mismatched += sorted(bad)
                lv.generated_tokens += sum(len(ref[rid]) for rid in complete)
                lv.tokens.update(ref)
                g_tokens += group[0]["graph"]["generated_tokens"]
                e_tokens += group[0]["eager"]["generated_tokens"]
            lv.mismatched.sort()
            lv.mismatches = len(lv.mismatched)
            lv.idle_rank_steps = sum(x["graph"]["schedule"].count(0) for x in done)
            g0, e0 = done[0]["graph"], done[0]["eager"]  # the ranks step in lockstep: rank 0's clock
            lv.tokens_per_s = g_tokens / g0["seconds"] if g0["seconds"] > 0 else None
            lv.eager_tokens_per_s = e_tokens / e0["seconds"] if e0["seconds"] > 0 else None
            lv.replays, lv.fallbacks, lv.tier_replays = g0["replays"], g0["fallbacks"], dict(g0["tier_replays"])
            lv.p50_step_ms, lv.p99_step_ms = g0["p50_step_ms"], g0["p99_step_ms"]
            lv.schedule = list(g0["schedule"])
            lv.first_decode_s = g0.get("first_decode_s")
            lv.eager_p50_step_ms, lv.eager_p99_step_ms = e0["p50_step_ms"], e0["p99_step_ms"]
        levels.append(lv)
    # A rank that never reported (died, killed at the deadline) faulted in the first level
    # that did not finish cleanly (the first level if none is known).
    if rank_errors:
        first = next((lv for lv in levels if lv.completed < lv.requests or lv.faults), levels[0])
        first.faults += len(rank_errors)
        first.errors += rank_errors
    return LoadtestResult(cfg, levels, errors=errors)


def _on_cuda(device: str) -> bool:
    """Whether ``device`` (``"auto"``, ``"cuda"``, ``"tape"``) means CUDA, as ``get_device`` decides it, without
    making a device (which would open a CUDA context in this launching process)."""
    from graphrunner.devices import DEVICE_ENV_VAR

    if device == "auto":
        device = os.environ.get(DEVICE_ENV_VAR, "auto").strip().lower() or "auto"
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def rank_backend(cfg: LoadtestConfig, local_ranks: int | None = None) -> str:
    """The ``torch.distributed`` backend of ``cfg``'s ranks: ``"nccl"`` when they run on CUDA
    (``device`` ``"cuda"``, or ``"auto"`` with CUDA available) with one GPU each, ``"gloo"`` on
    the CPU tape (and for one rank, which makes no process group). ``local_ranks``: the ranks
    on this machine (torchrun's ``LOCAL_WORLD_SIZE``; default: all of ``cfg.ranks``). Raises
    ``ValueError``, before anything is started, when the ranks would run on CUDA but this machine
    has fewer GPUs than its ranks or this torch has no NCCL: a gloo collective inside a captured
    CUDA step cannot be captured, so such a run could only fail."""
    if cfg.ranks == 1 or not _on_cuda(cfg.device):
        return "gloo"
    import torch.distributed as dist

    gpus = torch.cuda.device_count()
    local = cfg.ranks if local_ranks is None else local_ranks
    why = (
        "it captures an all_reduce inside the tensor-parallel step, which only an NCCL collective allows (one "
        "process per GPU)"
    )
    fix = "run fewer --ranks, or --device tape (the ranks on the CPU tape, over gloo)"
    if gpus < local:
        what = f"--ranks {cfg.ranks}" if local_ranks is None else f"{local} torchrun ranks on this node"
        raise ValueError(f"{what} on CUDA needs {local} GPUs, one per rank, and this machine has {gpus}: {why}; {fix}")
    if not dist.is_nccl_available():
        raise ValueError(
            f"--ranks {cfg.ranks} on CUDA needs NCCL, and this torch has none "
            f"(torch.distributed.is_nccl_available() is False): {why}; install a CUDA build of "
            f"PyTorch with NCCL, or {fix}"
        )
    return "nccl"


#: Seconds the default process group of the ranks allows its rendezvous and each collective
#: outside the runner's own group (the step's all_reduce, the exchange of the results).
INIT_TIMEOUT = 60.0


def run_loadtest(cfg: LoadtestConfig, launch_timeout: float = 3600.0) -> LoadtestResult:
    """Run the sweep described by ``cfg`` and return its :class:`LoadtestResult`.

    ``cfg.ranks == 1`` runs in this process (with ``cfg.threads`` torch threads).
    Under torchrun (:func:`~graphrunner_tools.launch.torchrun_env`; ``cfg.ranks`` must be its
    ``WORLD_SIZE``) this process runs its own rank's part in torchrun's group and every rank
    returns the combined result (``result.rank`` is this rank; a rank that failed returns its own
    part only). Otherwise ``cfg.ranks`` processes started by torch's elastic launcher
    (:func:`~graphrunner_tools.launch.launch_ranks`: one torch thread each unless ``cfg.threads``
    says more; gloo, or NCCL with one GPU per rank on CUDA: :func:`rank_backend`, whose
    ``ValueError`` comes before anything is started), bounded by ``launch_timeout`` seconds in
    all; the first rank that fails ends the run on every rank.
    """
    from graphrunner_tools.launch import launch_ranks, run_joined, torchrun_env
    from graphrunner_tools.threads import torch_threads

    env = torchrun_env()
    if env is not None and env.world_size > 1 and cfg.ranks != env.world_size:
        raise ValueError(
            f"ranks={cfg.ranks}, but this process is rank {env.rank} of a torchrun job of WORLD_SIZE="
            f"{env.world_size}: under torchrun the ranks are torchrun's; pass ranks={env.world_size} "
            "(on the command line: drop --ranks, or pass --dp/--tp whose product is WORLD_SIZE)"
        )
    joined = env is not None and env.world_size > 1
    backend = rank_backend(cfg, env.local_world_size if joined and env is not None else None)
    t0 = time.perf_counter()
    rank_errors: list[str] = []
    if cfg.ranks == 1:
        with torch_threads(cfg.threads):
            per_rank: list[dict[str, Any] | None] = [serve_rank(0, 1, cfg)]
    else:
        if joined:
            # the ranks step in lockstep: a peer that failed too reports within a group timeout of this
            # rank's end; one that has not by then is gone or stuck (torchrun stops its node's ranks)
            env, outcomes = run_joined(
                serve_levels,
                (cfg,),
                backend=backend,
                init_timeout=INIT_TIMEOUT,
                threads=cfg.threads,
                env=env,
                exchange_timeout=cfg.timeout + 10,
            )
        else:
            outcomes = launch_ranks(
                serve_levels,
                cfg.ranks,
                args=(cfg,),
                timeout=launch_timeout,
                init_timeout=INIT_TIMEOUT,
                threads=cfg.threads,
                backend=backend,
            )
        per_rank = [o.value for o in outcomes]  # a failed rank's partial result, or None
        rank_errors = [
            o.error if o.error.startswith(f"rank {o.rank} ") else f"rank {o.rank}: {o.error}"
            for o in outcomes
            if o.value is None and o.error
        ]
    result = _combine(cfg, per_rank, rank_errors)
    result.seconds = time.perf_counter() - t0
    result.dist_backend = backend if cfg.ranks > 1 else None
    result.rank = env.rank if joined and env is not None else None
    return result


def report(result: LoadtestResult, out: TextIO | None = None) -> None:
    """Print one line per level, then every error and the first mismatched requests."""
    out = sys.stdout if out is None else out
    cfg = result.config
    ranks = f"{cfg.ranks} rank(s)" if cfg.dp == 1 else f"{cfg.ranks} ranks (DP {cfg.dp} x TP {cfg.tp})"
    if result.dist_backend == "nccl":
        ranks += " over NCCL, one GPU each"
    elif result.dist_backend:
        ranks += f" over {result.dist_backend}"
    print(
        f"graphrunner loadtest: {ranks}, backend={cfg.backend}, {cfg.requests} requests per level, "
        f"prompt {cfg.prompt_len[0]}-{cfg.prompt_len[1]} / output {cfg.output_len[0]}-{cfg.output_len[1]} tokens, "
        f"{cfg.layers} layers"
        + (f", verify steps with 1-{cfg.spec} drafts per request" if cfg.spec else "")
        + (f", injected fault: {cfg.inject_fault}" if cfg.inject_fault else ""),
        file=out,
    )
    for lv in result.levels:
        print(lv.line(), file=out)
    for lv in result.levels:
        for e in lv.errors:
            print(f"  C{lv.concurrency} fault: {e}", file=out)
        if lv.mismatched:
            shown = ", ".join(map(str, lv.mismatched[:10])) + (" ..." if len(lv.mismatched) > 10 else "")
            print(
                f"  C{lv.concurrency} mismatch: generated tokens differ (graph vs eager, or across ranks) for "
                f"request(s) {shown}",
                file=out,
            )
        if lv.completed < lv.requests and not lv.errors:
            print(f"  C{lv.concurrency}: {lv.requests - lv.completed} request(s) lost", file=out)
    for e in result.errors:
        print(f"  fault: {e}", file=out)
    print(f"{'PASS' if result.ok else 'FAIL'} in {result.seconds:.1f}s", file=out)


# --------------------------------------------------------------------------- command line
def _range(text: str) -> tuple[int, int]:
    import argparse

    parts = text.split(",")
    try:
        lo, hi = (int(p) for p in parts) if len(parts) == 2 else (int(parts[0]),) * 2
    except ValueError:
        lo = hi = 0
    if lo < 1 or lo > hi:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX (or one N >= 1), got {text!r}")
    return lo, hi


def _seconds(text: str) -> float:
    import argparse

    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not v > 0 or not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return v


def _run_from_args(args: Any) -> int:
    from graphrunner_tools.launch import torchrun_env

    env = torchrun_env()
    if env is not None and env.rank != 0:  # a torchrun rank other than 0: no progress line
        args.no_progress = True
    cfg = LoadtestConfig(
        ranks=args.ranks,
        dp=args.dp or 1,
        requests=args.requests,
        concurrency=tuple(args.concurrency),
        backend=args.backend,
        device=args.device,
        layers=args.layers,
        seed=args.seed,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        timeout=args.timeout,
        inject_fault=args.inject_fault,
        threads=args.threads,
        progress=not args.no_progress,
        spec=args.spec,
        background_capture=args.background_capture,
    )
    result = run_loadtest(cfg)
    if result.rank not in (None, 0):  # torchrun: rank 0 prints the summary; another rank only its own fault
        for e in result.errors + [e for lv in result.levels for e in lv.errors]:
            if e.startswith(f"rank {result.rank}"):
                print(f"graphrunner loadtest: {e}", file=sys.stderr)
        return 0 if result.ok else 1
    report(result)
    if args.json:
        from graphrunner_tools.bench import write_json

        write_json(args.json, result.to_json())
        print(f"wrote {args.json}")
    return 0 if result.ok else 1


def check_args(parser: Any, args: Any) -> None:
    """Usage errors found after parsing (one line, exit 2 through ``parser.error``)."""
    from graphrunner_tools.launch import torchrun_env

    if args.spec < 0:
        parser.error(f"argument --spec: expected 0 (off) or K >= 1 drafts per request, got {args.spec}")
    try:
        env = torchrun_env()
    except ValueError as exc:
        parser.error(str(exc))
    world = env.world_size if env is not None else None
    if world is not None and args.ranks not in (None, world):
        parser.error(
            f"argument --ranks: {args.ranks}, but this process is a torchrun worker of WORLD_SIZE={world}, "
            "and under torchrun the ranks are torchrun's; drop --ranks (or pass --ranks "
            f"{world})"
        )
    if args.dp is not None or args.tp is not None:
        ranks = (args.dp or 1) * (args.tp or 1)
        if world is not None and ranks != world:
            parser.error(
                f"argument --dp/--tp: --dp x --tp = {ranks}, but torchrun started WORLD_SIZE={world} "
                f"ranks; pass --dp and --tp whose product is {world}"
            )
        if args.ranks not in (None, 1, ranks):
            parser.error(
                f"argument --ranks: {args.ranks} is not --dp x --tp = {ranks}; pass --dp and --tp, or --ranks alone"
            )
        args.ranks, args.dp = ranks, args.dp or 1
    else:
        args.ranks = world or args.ranks or 1
        args.dp = 1
    if args.inject_fault == "stall" and args.ranks < 2:
        parser.error("argument --inject-fault: stall stalls one rank while the others wait; it needs --ranks 2 or more")
    try:  # on CUDA: one GPU per rank and NCCL, found before any process is started
        rank_backend(
            LoadtestConfig(ranks=args.ranks, dp=args.dp, device=args.device),
            env.local_world_size if env is not None and env.world_size > 1 else None,
        )
    except ValueError as exc:
        parser.error(f"argument --ranks: {exc}")
    from graphrunner_tools.models import LlamaConfig

    cfg = LlamaConfig.demo()
    tp = args.ranks // args.dp
    for what, n, over in (
        ("intermediate_size", cfg.intermediate_size, args.ranks),
        ("num_heads * head_dim", cfg.hidden_size, tp),
    ):
        if n % over:
            parser.error(
                f"argument --ranks: the decoder's {what} ({n}) is split over {over} ranks and must be "
                f"divisible by it; use powers of two (--ranks, or --dp x --tp, up to {cfg.hidden_size})"
            )
    if args.json:
        import tempfile

        folder = os.path.dirname(os.path.abspath(args.json))
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as exc:
            parser.error(f"argument --json: cannot write under {folder!r} ({exc.strerror or exc}); pass another path")


def add_loadtest_subparser(subparsers: Any) -> Any:
    """Register ``graphrunner loadtest`` on ``subparsers``; sets ``func`` (returns the exit code)
    and ``check`` (post-parse usage checks). Returns the new subparser."""
    from graphrunner_tools.bench import parse_int_list
    from graphrunner_tools.threads import add_threads_argument, positive_int

    p = subparsers.add_parser(
        "loadtest",
        help="serve seeded requests with continuous batching through graphs and eager, on N ranks; compare every token",
        description="For each concurrency level, serve the same seeded requests (per-request prompt and output "
        "lengths) with a continuous-batching engine over the demo decoder, once through GraphRunner "
        "(decode graphs per batch bucket, a padding slot in the KV cache) and once through an eager "
        "engine with the same scheduling decisions, and compare every generated token. --spec K makes every "
        "step a speculative verify step (1..K seeded drafts per request, verify graphs per (reqs, "
        "draft) tier, greedy acceptance) instead of a decode step. --ranks N runs "
        "N processes with a tensor-parallel decoder (an all_reduce inside the captured step): gloo on the "
        "CPU tape; on CUDA NCCL with one GPU per rank (fewer GPUs than ranks is refused before anything "
        "starts); the processes are started by torch's elastic launcher, and the first that fails ends "
        "the run on every rank. Run under torchrun (one node or several: torchrun --nnodes 2 ... "
        "graphrunner loadtest ...), every process runs its own rank in torchrun's group (env://) and "
        "rank 0 prints the summary and writes --json. "
        "--dp D --tp T runs D*T processes serving data-parallel: a seeded uneven scheduler splits the "
        "requests over D groups (ranks run different batch sizes at the same step, some 0 rows), "
        "attention split over a group's T ranks, the MLP spanning all ranks like an MoE layer. "
        "Prints one line per level; exits 1 on a lost request, a fault (an exception on any rank, a "
        "timeout, NaN/inf logits) or a mismatch, 2 (one line on stderr) for a bad command line.",
    )
    p.add_argument(
        "--ranks",
        type=positive_int,
        default=None,
        help="ranks: 1 in process, N > 1 processes started by torch's elastic launcher (gloo on the tape; "
        "on CUDA NCCL, one GPU per rank: N GPUs needed) (default: 1; under torchrun: torchrun's "
        "WORLD_SIZE, each process running its own rank)",
    )
    p.add_argument(
        "--dp",
        type=positive_int,
        default=None,
        help="data-parallel groups D (DP attention; needs --tp or defaults it to 1): D*T processes, each "
        "group serving its own share of the requests; --concurrency is per group (default: off)",
    )
    p.add_argument(
        "--tp",
        type=positive_int,
        default=None,
        help="tensor-parallel ranks T per data-parallel group (with --dp; default: 1)",
    )
    p.add_argument(
        "--requests",
        type=positive_int,
        default=DEFAULT_REQUESTS,
        help=f"requests served per level (default: {DEFAULT_REQUESTS})",
    )
    p.add_argument(
        "--concurrency",
        type=parse_int_list,
        default=list(DEFAULT_CONCURRENCY),
        help="comma-separated levels: the most requests running together "
        f"(default: {','.join(map(str, DEFAULT_CONCURRENCY))})",
    )
    p.add_argument(
        "--backend",
        default="breakable",
        choices=["full", "breakable"],
        help="breakable: attention is an eager break (default); full: one graph per bucket (masked attention)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "tape", "cuda"],
        help="graph kind: cuda when available, else tape (default: auto)",
    )
    p.add_argument("--json", default="", help="write the results as JSON to this path")
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers (default: 2)")
    p.add_argument("--prompt-len", type=_range, default=(4, 32), help="prompt length range MIN,MAX (default: 4,32)")
    p.add_argument(
        "--output-len", type=_range, default=(2, 32), help="generated tokens per request, range MIN,MAX (default: 2,32)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the requests (default: 0)")
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=30.0,
        help="the rank group's timeout in seconds: a rank stuck longer makes the others raise "
        "RankTimeoutError (default: 30)",
    )
    p.add_argument(
        "--inject-fault",
        default=None,
        choices=list(FAULTS),
        help="test-only: 'mismatch' perturbs one replayed output (must exit 1 with a mismatch); 'stall' "
        "stalls the last rank inside a step (must exit 1 with RankTimeoutError)",
    )
    p.add_argument(
        "--spec",
        type=int,
        default=0,
        metavar="K",
        help="verify steps instead of decode steps: every running request proposes 1..K seeded draft "
        "tokens per step, served by verify graphs per (reqs, draft) tier and greedy acceptance "
        "(default: 0, off)",
    )
    p.add_argument(
        "--background-capture",
        action="store_true",
        help="capture the graph runner with capture(background=True): the first level is served from "
        "its first step (eagerly, padded, until each bucket is captured); every token is still "
        "compared with the eager engine. The first level's line shows when its first decode step "
        "was served, counted from the start of the capture",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress line (drawn on a terminal only)")
    add_threads_argument(p)
    p.set_defaults(func=_run_from_args, check=check_args)
    return p
