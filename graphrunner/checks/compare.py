"""Localise a divergence: run a captured runner's graph and an eager reference on the same inputs, op by op.

``runner.compare(**inputs)`` (:func:`compare_runner`) stages ``inputs`` in
the runner's static buffers and pads them to their key with the runner's
own stager, exactly as a call does (any key space: named dims too), then:

1. replays the key's graph, recording (through the one op recorder,
   :mod:`graphrunner.recording.ops`) the ops a dispatch mode sees (on
   the tape every op of every segment, on CUDA only the eager breaks:
   segment kernels are invisible to the host), as a call would;
2. puts back everything the replay wrote -- tensors that are not created by
   the step and that an op wrote in place or through ``out=`` (a KV cache, a
   counter tensor) get their cells back, logged before each write
   (:class:`~graphrunner.recording.ops.WriteGuard`) --; both runs draw from copies of the engine's
   generators (:class:`~graphrunner.tape.rng.OwnedGenerators`), never from the engine's own;
3. runs ``step`` eagerly on the same padded inputs (the reference),
   recording every aten op with its output values, its source line (the
   user's frame: :mod:`graphrunner._frames`) and whether it ran in a graph
   segment or in an eager break (``@no_graph`` body);
4. puts back the step's writes again, and the runner's static input
   buffers, so the runner and its cache are as before (the generators were never touched; on
   CUDA a segment's kernels draw from the device's generator, which the host cannot redirect).

Python state is not put back: a step that changes a Python attribute when
it runs eagerly (a counter) has changed it once more after ``compare``.
On CUDA, writes made inside graph segments are not seen by the host, so a
cache only the segments write is not snapshotted there.

The two op streams are aligned in order (an op of the graph is matched with
the next eager op of the same name and output shapes; the graph may have
dropped or hoisted ops), and the first aligned pair whose outputs differ is
reported: op, ``file:line``, max abs diff, and the segment or eager break
it ran in. The report (:class:`CompareReport`) has ``.equal`` and a
``str()`` naming the location.

It costs a clone of every op output of one step: a debugging tool, not for
the serving path. On a multi-rank runner every rank must call it together
(the step's collectives run, the runner's bucket agreement does not).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from graphrunner._frames import where
from graphrunner._pytree import flatten
from graphrunner.errors import CaptureError
from graphrunner.keys import region
from graphrunner.recording.ops import OpConsumer, OpEvent, OpRecorder, WriteGuard, tensors_in
from graphrunner.tape.rng import OwnedGenerators

__all__ = ["CompareReport", "compare_runner"]

#: Aliasing ops: they compute nothing, and a graph drops or hoists them.
_SKIP = frozenset(
    (
        "aten::detach",
        "aten::alias",
        "aten::view",
        "aten::_unsafe_view",
        "aten::as_strided",
        "aten::t",
        "aten::transpose",
        "aten::permute",
        "aten::expand",
        "aten::slice",
        "aten::select",
        "aten::unsqueeze",
        "aten::squeeze",
        "aten::reshape",
        "aten::lift_fresh",
        # data movement: a graph adds copies (into survivors, eager-break results, its output
        # buffer); a difference they carry shows in the next op that computes
        "aten::copy_",
        "aten::clone",
        "aten::_to_copy",
        # uninitialised memory
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::new_empty_strided",
    )
)


@dataclass
class _OpValue:
    op: str  # overload packet, e.g. "aten.addmm"
    outs: tuple[torch.Tensor, ...]
    where: tuple[str, int, str] | None
    context: str  # "graph segment 1" / "eager break add_pos"

    def signature(self) -> tuple:
        return (self.op, tuple((tuple(t.shape), t.dtype) for t in self.outs))


@dataclass
class CompareReport:
    """The result of :func:`compare_runner` / ``runner.compare(**inputs)``.

    ``equal``: the graph's outputs equal the eager reference's (within
    ``atol``). ``bucket`` and ``batch``: the bucket replayed and the real
    rows. ``max_abs_diff``: the largest difference over the outputs' real
    rows, and ``output``: the path of the output that has it (``output``,
    ``output['logits']``, ``output[1]``). When they differ, ``op``,
    ``where`` (``(file, line, function)``), ``op_diff`` (that op's max abs
    diff) and ``context`` (the graph segment or eager break it ran in) name
    the first op whose output differs; ``op`` is ``None`` when no op could
    be aligned (e.g. on CUDA, when the first difference is inside a
    segment, ``context`` names the segment before the first differing eager
    break or output). ``str(report)`` says all of it in one paragraph.
    """

    equal: bool
    bucket: Any
    batch: int
    max_abs_diff: float = 0.0
    output: str | None = None
    op: str | None = None
    where: tuple[str, int, str] | None = None
    op_diff: float | None = None
    context: str | None = None
    restored: list[str] = field(default_factory=list)

    @property
    def location(self) -> str:
        """``file:line`` of the first differing op (``"-"`` when unknown)."""
        return "-" if self.where is None else f"{self.where[0]}:{self.where[1]}"

    def __str__(self) -> str:
        head = f"bucket {self.bucket} (batch {self.batch})"
        if self.equal:
            return f"equal: the graph and eager PyTorch agree on {head}"
        text = (
            f"differ: on {head} the graph and eager PyTorch differ by up to {self.max_abs_diff:.6g} (at {self.output})"
        )
        if self.op is not None:
            text += (
                f"; the first op whose output differs is {self.op} at {where(self.where)} "
                f"(max abs diff {self.op_diff:.6g}), in {self.context}"
            )
        elif self.context is not None:
            text += f"; the difference starts in {self.context}"
        if self.context and self.context.startswith("eager break"):
            hint = (
                "the eager break reruns at every replay, but the Python code of the graph segments around it "
                "ran only at capture: a value it reads that segment code sets (a Python attribute, a "
                "counter) is the capture-time one. Pass it to the break as a tensor argument, or move the "
                "code that sets it into the break"
            )
        else:
            hint = (
                "the graph reads what it read at capture: a module tensor re-bound since (layer.weight = "
                "nn.Parameter(...)), a resized cache or a Python number is stale. Update tensors in place "
                "(.copy_()), or re-capture (runner.cleanup(); runner.capture()), or make the value an input"
            )
        return f"{text}. Likely cause: {hint}. See docs/debugging.md"


class _Recorder(OpConsumer):
    """An op consumer that records ops (values, lines, context) and the storages they write."""

    def __init__(self, state: WriteGuard, locate: bool):
        self.state, self.locate = state, locate
        self.generators = state.generators  # the recorder redirects the run's draws to them
        self.ops: list[_OpValue] = []
        self._segment = 1
        self._in_break = False

    def _context(self, ev: OpEvent) -> str:
        if ev.in_eager_break:
            self._in_break = True
            fn = ev.break_fn
            return f"eager break {getattr(fn, '__qualname__', fn)}"
        if self._in_break:
            self._in_break = False
            self._segment += 1
        return f"graph segment {self._segment}"

    def before(self, ev: OpEvent) -> None:
        self.state.before(ev)

    def after(self, ev: OpEvent) -> None:
        self.state.after(ev)
        if ev.name in _SKIP:
            return
        outs = tuple(tensors_in(ev.out))
        if not outs:
            return
        with _disable_current_modes():
            vals = tuple(t.detach().clone() for t in outs)
        loc = ev.where if self.locate else None
        ctx = self._context(ev) if self.locate else ""
        self.ops.append(_OpValue(str(ev.func.overloadpacket), vals, loc, ctx))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    if a.is_floating_point() or a.is_complex():
        d = (a.double() - b.double()).abs()
        same_nan = torch.isnan(a) & torch.isnan(b)
        d = torch.where(same_nan, torch.zeros_like(d), d)
        d = torch.nan_to_num(d, nan=float("inf"))
        return float(d.max())
    return float((a.long() - b.long()).abs().max()) if a.dtype != torch.bool else float((a != b).any())


def _first_divergence(graph_ops: list[_OpValue], eager_ops: list[_OpValue], atol: float):
    j = 0
    for g in graph_ops:
        sig = g.signature()
        k = next((i for i in range(j, len(eager_ops)) if eager_ops[i].signature() == sig), None)
        if k is None:
            continue
        e = eager_ops[k]
        j = k + 1
        d = max((_max_diff(x, y) for x, y in zip(g.outs, e.outs)), default=0.0)
        if d > atol:
            return e, d
    return None


def _paths(out: Any) -> list[str]:
    spec, leaves = flatten(out)
    if isinstance(out, torch.Tensor):
        return ["output"]
    if isinstance(out, Mapping):
        keys = list(out.keys())
        if len(keys) == len(leaves):
            return [f"output[{k!r}]" for k in keys]
    if isinstance(out, (list, tuple)) and len(out) == len(leaves):
        return [f"output[{i}]" for i in range(len(out))]
    return [f"output leaf {i}" for i in range(len(leaves))]


def compare_runner(server: Any, inputs: Mapping[str, torch.Tensor], atol: float = 0.0) -> CompareReport:
    """Compare the graph of a runner's ``server`` (:class:`graphrunner.serving.Server`, ``runner.server``)
    with eager PyTorch on ``inputs``; see the module docstring.

    ``inputs`` are as for a call (every declared name, with the runner's
    dims: any key space). They are validated and staged by the runner's own
    stager (:class:`~graphrunner.staging.StaticInputs`) exactly as a call
    would stage them. Raises :class:`CaptureError` before
    ``runner.capture()``, the call's ``ValueError``/``TypeError`` for
    invalid inputs, and ``ValueError`` when the sizes fall back (no key
    replays them: there is no graph to compare). Outputs are compared on
    their real cells; ``atol`` is the largest difference still called equal
    (default 0: the tape replays bit for bit).
    """
    if not server.serving:
        raise CaptureError("runner.compare() needs a captured runner: call runner.capture() first")
    staging, space, backend = server.inputs, server.space, server.backend
    tensors, sizes = staging.validate(inputs)
    key = space.choose(sizes)[0] if staging.fits(sizes) else None
    ext = None if key is None else space.external(key)
    if key is None or not backend.can_run(ext):
        raise ValueError(
            f"runner.compare(): {space.describe(sizes)} falls back to eager (no captured key "
            "replays it): there is no graph to compare; pass sizes that fit a key"
        )
    saved_static = {k: v.clone() for k, v in staging.buffers.items()}
    saved_filled = staging.filled
    staging.stage(tensors, sizes)
    staging.pad_to(sizes, key)
    static = staging.key_views(key)
    padded = {k: v.clone() for k, v in static.items()}  # the eager reference's own copy of the padded inputs
    # both runs draw from copies of the engine's generators (the tape's replay too: it replays
    # under the recorder), reset between them: the engine's generators are never drawn from nor set
    state = WriteGuard(list(padded.values()) + list(static.values()), generators=OwnedGenerators())
    stop = compare_runner.__code__
    try:
        # The graph first: it sees the Python state a call would see now (an
        # eager break reading a value the segment code set at capture).
        graph_rec = _Recorder(state, locate=False)
        with torch.inference_mode(), OpRecorder([graph_rec], stop=stop):
            result = backend.replay(ext)
        _, graph_leaves = flatten(result)
        graph_out = [t.detach().clone() for t in graph_leaves]
        state.restore()
        eager_rec = _Recorder(state, locate=True)
        with torch.inference_mode(), OpRecorder([eager_rec], stop=stop):
            out = server.step(**padded)
            _, leaves = flatten(out)
            eager_out = [torch.empty_like(t).copy_(t) for t in leaves]  # the graph copies into its buffer too
    finally:
        state.restore()
        for k, v in staging.buffers.items():
            v.copy_(saved_static[k])
        staging.filled = saved_filled
    paths = _paths(out)
    spec, _ = flatten(out)
    dims = server.layout.leaf_dims(spec, len(paths))
    worst, at = 0.0, None
    for path, e, g, d in zip(paths, eager_out, graph_out, dims):
        if e.dim() >= 1 and d:
            e, g = e[region(sizes, d)], g[region(sizes, d)]
        diff = _max_diff(e, g)
        if diff > worst:
            worst, at = diff, path
    report = CompareReport(
        equal=worst <= atol,
        bucket=ext,
        batch=sizes[0] if space.one_batch_dim else sizes,
        max_abs_diff=worst,
        output=at,
        restored=list(state.snapshots.values()),
    )
    if report.equal:
        return report
    found = _first_divergence(graph_rec.ops, eager_rec.ops, atol)
    if found is not None:
        e, d = found
        report.op, report.where, report.op_diff, report.context = e.op, e.where, d, e.context
    return report
