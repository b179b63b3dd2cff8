"""``graphrunner verify``: a speculative-decoding verify step, captured per (reqs, draft) tier.

The demo decoder (:mod:`graphrunner_tools.models`, random weights) serves ``requests`` prompts
with a draft-and-verify loop. Each step every unfinished request proposes a ragged number
of draft tokens (``1..k``, seeded). The verify step runs the decoder over a
``[reqs, draft]`` grid of cells (per request: its last accepted token, then its drafts)
against the KV cache and returns logits ``[reqs, draft, vocab]``. It is captured once per
(reqs, draft) tier by :class:`~graphrunner.GraphRunner` (``buckets={"reqs": ..., "draft":
...}``) and replayed. Greedy acceptance keeps the longest prefix of drafts equal to the
model's own argmax, plus the bonus token.

Padding. A padded cell (beyond a request's drafts, or a whole padded request row) has
position 0 after padding; left alone it would overwrite the K/V of the request's first
token. :func:`verify_step_fn` masks it: cells at or beyond ``lens[b]`` write and read the
scratch position ``max_seq_len - 1``, which no real query attends; padded rows use the
scratch cache row ``requests`` (the ``slots`` pad value). ``mask=False`` removes the mask
(the tests' negative control).

Checks, every step: the graph's logits on the real cells are bit-for-bit the logits of an
independent eager model (same weights, own KV cache) on the same padded inputs; both make
the same accept decisions; the runner replayed the key every rank agreed on. At the end
the generated tokens must equal plain greedy decoding (speculative greedy decoding is
exact), except after a near-tie of the top two logits (reported, not counted: float
rounding may break it either way).

Ranks. With ``world > 1`` every rank runs this in its own process (gloo; started by torch's
elastic launcher, :func:`run_spec_ranks`, or torchrun's own workers, :func:`run_spec_joined`): the MLP is
split tensor-parallel (an ``all_reduce`` inside the captured step). All ranks see the same
requests and drafts, and each pads its batch to a rank-dependent local tier (as if each
rank's budget had picked its own), so ranks call the runner with different sizes; the
runner's one agreement per call makes them replay the same key. ``agree=False`` (test
only) turns the agreement off: ranks replay different keys and the run ends in an error
(a failed or timed-out collective, within ``group_timeout``), never a hang.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
from torch import nn

from graphrunner.breakable import no_graph
from graphrunner.inputs import BatchInput
from graphrunner.progress import StatusLine
from graphrunner_tools.launch import RankOutcome, launch_ranks, run_joined
from graphrunner_tools.models import LlamaConfig, build_model
from graphrunner_tools.models.tp import shard_tensor_parallel

__all__ = ["SpecResult", "verify_step_fn", "accept", "run_spec", "run_spec_ranks", "run_spec_joined"]

#: A plain-greedy token is a near-tie when its top-2 logit margin is below this (not a mismatch).
NEAR_TIE = 1e-3
#: Intermediate (MLP) width of the verify model; ``--ranks`` must divide it.
MLP_WIDTH = 192
#: Probability that a draft token is the greedy token (otherwise a random one): drafts get accepted and rejected.
DRAFT_HIT = 0.6


@dataclass
class SpecResult:
    """What one rank's verify run did; ``ok`` is False on any mismatch.

    ``replays`` maps each (reqs, draft) tier (as ``"RxD"``) to its replays; ``mismatches``
    sums ``logit_mismatches`` (graph logits != eager logits on the real cells, bit for
    bit), ``token_mismatches`` (different accept decisions), ``key_mismatches`` (the
    runner replayed another key than the one agreed from every rank's sizes) and
    ``greedy_mismatches`` (requests whose tokens differ from plain greedy decoding before
    any near-tie); ``near_ties`` counts requests that diverged from plain greedy only after
    a near-tie.
    """

    rank: int
    world: int
    requests: int
    steps: int
    tokens: int
    drafted: int
    accepted: int
    replays: dict[str, int] = field(default_factory=dict)
    fallbacks: int = 0
    fallback_reasons: dict[str, int] = field(default_factory=dict)
    logit_mismatches: int = 0
    token_mismatches: int = 0
    key_mismatches: int = 0
    greedy_mismatches: int = 0
    near_ties: int = 0

    @property
    def mismatches(self) -> int:
        """Every mismatch counted (the run fails when non-zero)."""
        return self.logit_mismatches + self.token_mismatches + self.key_mismatches + self.greedy_mismatches

    @property
    def ok(self) -> bool:
        """True when nothing mismatched."""
        return self.mismatches == 0


def verify_step_fn(model: nn.Module, mask: bool = True):
    """The verify step of ``model``: ``step(tokens, positions, lens, slots) -> logits [R, D, vocab]``.

    ``tokens``/``positions`` are ``[R, D]``, ``lens``/``slots`` ``[R]``. Cell ``(b, t)`` with
    ``t >= lens[b]`` is padding: with ``mask`` (default) its position becomes the scratch
    position ``max_seq_len - 1`` (written, never attended by a real cell), so padded cells
    never change real ones. ``mask=False`` leaves padded positions as given (0 after
    padding): they overwrite real K/V (negative control only).
    """
    scratch = model.config.max_seq_len - 1

    def step(tokens: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor):
        if mask:
            positions = mask_padding(positions, lens, scratch)
        return model.verify_step(tokens, positions, slots)

    return step


@no_graph
def mask_padding(positions: torch.Tensor, lens: torch.Tensor, scratch: int) -> torch.Tensor:
    """``positions`` with every cell ``(b, t >= lens[b])`` moved to ``scratch``.

    An eager break (``@no_graph``): the ``varlen`` attention break reads the masked positions
    on the host, and a tensor computed inside a graph segment holds uninitialised memory at
    capture time on a GPU (poison on the tape: ``GRAPHRUNNER_TAPE_POISON=1``) until the
    first replay; computed eagerly it is real at capture and refreshed at every replay. In a
    full graph (``masked`` attention, no host read) it is captured like any other code.
    """
    cells = torch.arange(positions.shape[1], device=positions.device)
    return positions.masked_fill(cells[None, :] >= lens[:, None], scratch)


def _budget_padding(rank: int, step: int) -> tuple[int, int]:
    """Extra (reqs, draft) cells rank ``rank`` pads step ``step`` to: its own local tier."""
    return (rank + step) % 2, (rank * (step + 1)) % 3


def _local_sizes(rank: int, step: int, real: tuple[int, int]) -> tuple[int, int]:
    """This rank's local sizes for ``real`` (reqs, draft) sizes: its budget's padding added
    (above the largest bucket, every rank falls back together)."""
    er, ed = _budget_padding(rank, step)
    return real[0] + er, real[1] + ed


def _pad2(t: torch.Tensor, shape: tuple[int, ...], value: int) -> torch.Tensor:
    out = t.new_full(shape, value)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def _greedy(model: nn.Module, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], list[list[float]]]:
    """Plain greedy decoding of every prompt (eager); the tokens and each token's top-2 logit margin."""
    model.reset_cache()
    first = [model.prefill(torch.tensor([p]), slot_ids=torch.tensor([i]))[0, -1] for i, p in enumerate(prompts)]
    logits = torch.stack(first)
    toks: list[list[int]] = [[] for _ in prompts]
    margins: list[list[float]] = [[] for _ in prompts]
    slots = torch.arange(len(prompts))
    for j in range(max_new):
        top = logits.topk(2, dim=-1)
        for i in range(len(prompts)):
            toks[i].append(int(top.indices[i, 0]))
            margins[i].append(float(top.values[i, 0] - top.values[i, 1]))
        if j + 1 < max_new:
            ids = torch.tensor([t[-1] for t in toks])
            pos = torch.tensor([len(p) + j for p in prompts])
            logits = model.decode_step(ids, pos, slots)
    return toks, margins


def accept(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """Greedy acceptance of one request's verify logits ``[cells, vocab]`` (cell 0: the last
    accepted token, then one cell per draft; extra padded cells are ignored): the longest
    prefix of ``drafts`` equal to the argmax of the cell before each, then the bonus token
    (the argmax after the last accepted draft). Returns ``1 .. len(drafts) + 1`` tokens."""
    best = logits.argmax(-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return drafts[:n] + [best[n]]


def run_spec(
    requests: int = 6,
    max_new: int = 16,
    k: int = 4,
    reqs_buckets: Sequence[int] = (1, 2, 4, 8),
    draft_buckets: Sequence[int] = (2, 4, 6),
    backend: str = "breakable",
    seed: int = 0,
    layers: int = 2,
    rank: int = 0,
    world: int = 1,
    agree: bool = True,
    group_timeout: float = 30.0,
    plant_mismatch: bool = False,
    progress: bool = True,
    out: TextIO | None = None,
) -> SpecResult:
    """Run the verify loop on this rank and return its :class:`SpecResult` (module docstring).

    ``draft_buckets`` bucket the cells per request (last token + drafts, ``2..k+1``):
    a step whose cells, agreed over the ranks, exceed the largest takes the eager fallback.
    ``world > 1`` needs an initialised ``torch.distributed`` (gloo) of that size, this
    process being ``rank`` (:func:`run_spec_ranks` starts one). Graphs are tape graphs on
    CPU (the model and the gloo collectives live on the CPU). ``agree=False`` disables
    the runner's agreement (UNSAFE, test only). ``plant_mismatch`` (test only) perturbs the
    graph model's KV cache after the first step, so the eager check must fail.
    """
    import graphrunner as gr

    out = sys.stdout if out is None else out
    if backend not in ("full", "breakable"):
        raise ValueError(f"backend must be 'full' or 'breakable', got {backend!r}")
    if requests < 1 or max_new < 1 or k < 1:
        raise ValueError(f"requests, max_new and k must be >= 1, got {requests}, {max_new}, {k}")
    if max(reqs_buckets) < requests:
        raise ValueError(f"the largest reqs bucket ({max(reqs_buckets)}) must hold all {requests} requests")
    config = LlamaConfig.tiny(
        num_layers=layers,
        attention="masked" if backend == "full" else "varlen",
        max_seq_len=6 + max_new + k + 2,
        max_batch_size=requests + 1,
        intermediate_size=MLP_WIDTH,
    )
    vocab = config.vocab_size
    rng = random.Random(seed)  # the same draws on every rank: same prompts and drafts
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(2, 6))] for _ in range(requests)]
    models = [build_model(config, seed=seed) for _ in range(2)]
    if world > 1:  # the MLP only: its width (MLP_WIDTH) is what --ranks must divide
        models = [shard_tensor_parallel(m, rank, world, attention=False) for m in models]
    graph_model, eager_model = models
    scratch_slot = requests
    group = gr.TorchDistGroup(timeout=group_timeout) if world > 1 else None
    dims = ("reqs", "draft")
    runner = gr.GraphRunner(
        verify_step_fn(graph_model),
        inputs={
            "tokens": BatchInput(dtype=torch.long, pad=0, dims=dims),
            "positions": BatchInput(dtype=torch.long, pad=0, dims=dims),
            "lens": BatchInput(dtype=torch.long, pad=0, dims=("reqs",)),
            "slots": BatchInput(dtype=torch.long, pad=scratch_slot, dims=("reqs",)),
        },
        buckets={"reqs": list(reqs_buckets), "draft": list(draft_buckets)},
        outputs=dims,
        backend=backend,
        device="tape",
        group=group,
        progress=progress and rank == 0,
        # no padding check: a verify step's real cells are ragged (lens per request) and its padded cells
        # share one scratch position; every accepted token is compared with the eager oracle instead
        checks=("drift", "fingerprint"),
    )
    runner.agree_bucket = agree  # False: UNSAFE, test only
    talk = rank == 0
    if talk:
        print(
            f"graphrunner verify: {requests} requests x {max_new} new tokens, 1..{k} drafts per request and "
            f"step, buckets reqs={list(reqs_buckets)} draft={list(draft_buckets)} (cells = last token + drafts), "
            f"backend={backend}, {world} rank(s){' (tensor-parallel MLP)' if world > 1 else ''}",
            file=out,
        )
    report = runner.capture()
    if talk:
        print(report.table(), file=out)
    eager_step = verify_step_fn(eager_model)

    with torch.inference_mode():
        oracle, margins = _greedy(eager_model, prompts, max_new)
    for m in models:
        m.reset_cache()  # capture and the greedy run wrote K/V: start from clean caches (addresses kept)
    gen: list[list[int]] = []
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            first = [m.prefill(torch.tensor([p]), slot_ids=torch.tensor([i]))[0, -1].argmax() for m in models]
            gen.append([int(first[0])])

    res = SpecResult(rank=rank, world=world, requests=requests, steps=0, tokens=0, drafted=0, accepted=0)
    status = StatusLine() if progress and talk else None
    if status is not None and not status.tty:
        status = None  # progress only on a terminal
    step = 0
    while True:
        active = [i for i in range(requests) if len(gen[i]) < max_new]
        if not active:
            break
        drafts = []
        for i in active:
            base = len(gen[i]) - 1
            d = [
                oracle[i][base + j] if base + j < max_new and rng.random() < DRAFT_HIT else rng.randrange(vocab)
                for j in range(1, rng.randint(1, k) + 1)
            ]
            drafts.append(d)
        real = (len(active), 1 + max(len(d) for d in drafts))
        tokens = torch.zeros(real, dtype=torch.long)
        positions = torch.zeros(real, dtype=torch.long)
        lens = torch.tensor([1 + len(d) for d in drafts])
        slots = torch.tensor(active)
        for r, (i, d) in enumerate(zip(active, drafts)):
            start = len(prompts[i]) + len(gen[i]) - 1
            tokens[r, : 1 + len(d)] = torch.tensor([gen[i][-1]] + d)
            positions[r, : 1 + len(d)] = torch.arange(start, start + 1 + len(d))
        local = _local_sizes(rank, step, real)
        agreed = tuple(max(_local_sizes(q, step, real)[a] for q in range(world)) for a in range(2))
        want = runner.key_for(agreed)
        shape = want if want is not None else agreed

        def padded(to, tokens=tokens, positions=positions, lens=lens, slots=slots):
            return dict(
                tokens=_pad2(tokens, to, 0),
                positions=_pad2(positions, to, 0),
                lens=_pad2(lens, to[:1], 0),
                slots=_pad2(slots, to[:1], scratch_slot),
            )

        got = runner(**padded(local))[: real[0], : real[1]].clone()
        if runner.stats.last_bucket != want:
            res.key_mismatches += 1
        with torch.inference_mode():
            ref = eager_step(**padded(shape))[: real[0], : real[1]]
        if not torch.equal(got, ref):
            res.logit_mismatches += 1
        for r, (i, d) in enumerate(zip(active, drafts)):
            mine = accept(got[r], d)
            if mine != accept(ref[r], d):
                res.token_mismatches += 1
            gen[i].extend(mine)
            res.drafted += len(d)
            res.accepted += len(mine) - 1
        if plant_mismatch and step == 0:
            graph_model.kv_cache_tensors()[0][0, :, 0] += 1.0  # the graph's cache drifts from eager's
        step += 1
        if status is not None:
            status.write(
                f"verify: step {step}, {sum(min(len(g), max_new) for g in gen)}/{requests * max_new} "
                f"tokens, mismatches {res.mismatches}"
            )
    if status is not None:
        status.write(f"verify: {step} steps done", final=True)

    for i in range(requests):
        mine = gen[i][:max_new]
        diff = next((j for j in range(max_new) if mine[j] != oracle[i][j]), None)
        if diff is not None:
            if any(m < NEAR_TIE for m in margins[i][: diff + 1]):
                res.near_ties += 1
            else:
                res.greedy_mismatches += 1
    stats = runner.stats
    res.steps, res.tokens = step, requests * max_new
    res.replays = {"x".join(map(str, key)): n for key, n in stats.replays.items() if n}
    res.fallbacks, res.fallback_reasons = stats.fallbacks, dict(stats.fallback_reasons)
    runner.cleanup()
    if talk:
        print(summary(res), file=out)
    return res


def summary(res: SpecResult) -> str:
    """The verify run's report: requests, steps, tokens, replays per tier, fallbacks, mismatches, verdict."""
    tiers = (
        ", ".join(f"{k}: {v}" for k, v in sorted(res.replays.items(), key=lambda kv: tuple(map(int, kv[0].split("x")))))
        or "none"
    )
    return "\n".join(
        [
            f"requests: {res.requests}, steps: {res.steps}, tokens: {res.tokens}, drafts: {res.drafted} proposed, "
            f"{res.accepted} accepted ({res.accepted / max(res.drafted, 1):.0%})",
            f"replays per tier (reqs x draft): {tiers}",
            f"fallbacks: {res.fallbacks} {res.fallback_reasons or ''}".rstrip(),
            f"mismatches: {res.mismatches} (graph vs eager logits {res.logit_mismatches}, accept decisions "
            f"{res.token_mismatches}, agreed key {res.key_mismatches}, vs plain greedy {res.greedy_mismatches}; "
            f"near-ties not counted: {res.near_ties})",
            "verify: OK" if res.ok else "verify: FAILED (see above)",
        ]
    )


def _spec_rank(rank: int, world: int, kwargs: dict[str, Any]) -> SpecResult:
    """One spawned rank of :func:`run_spec_ranks`: :func:`run_spec` (only rank 0 prints)."""
    if rank == 0:
        return run_spec(rank=rank, world=world, **kwargs)
    with open(os.devnull, "w") as out:
        return run_spec(rank=rank, world=world, out=out, **kwargs)


def run_spec_ranks(ranks: int, timeout: float = 300.0, threads: int = 1, **kwargs: Any) -> list[RankOutcome]:
    """Run :func:`run_spec` on ``ranks`` gloo processes (``threads`` torch threads each) started
    by torch's elastic launcher (:func:`graphrunner_tools.launch.launch_ranks`); one
    :class:`~graphrunner_tools.launch.RankOutcome` per rank (``value``: its :class:`SpecResult`
    when ``ok``, else ``error`` says why). The whole run is bounded by ``timeout`` seconds (ranks
    still running then are killed), and the first rank that fails ends the run on every rank."""
    return launch_ranks(_spec_rank, ranks, args=(kwargs,), timeout=timeout, threads=threads)


def run_spec_joined(threads: int = 1, **kwargs: Any) -> tuple[int, list[RankOutcome]]:
    """This torchrun worker's rank of :func:`run_spec` in torchrun's group (gloo, ``env://``:
    :func:`graphrunner_tools.launch.run_joined`); returns ``(rank, outcomes)``, every rank's
    :class:`~graphrunner_tools.launch.RankOutcome` as after :func:`run_spec_ranks` (a rank that
    failed knows only its own)."""
    timeout = float(kwargs.get("group_timeout", 30.0))  # lockstep ranks: a failed peer reports within one of them
    env, outcomes = run_joined(_spec_rank, (kwargs,), backend="gloo", threads=threads, exchange_timeout=timeout + 10)
    return env.rank, outcomes
