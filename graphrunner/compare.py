"""Localise a divergence: run a captured runner's graph and an eager reference on the same inputs, op by op.

``runner.compare(**inputs)`` (:func:`compare_runner`) pads ``inputs`` to
their bucket exactly as a call does, then:

1. replays the bucket's graph, recording the ops a dispatch mode sees (on
   the tape every op of every segment, on CUDA only the eager breaks:
   segment kernels are invisible to the host), as a call would;
2. puts back everything the replay wrote -- tensors that are not created by
   the step and that an op wrote in place or through ``out=`` (a KV cache, a
   counter tensor) get their bytes back, snapshotted before their first
   write --, and the default generator its state;
3. runs ``step`` eagerly on the same padded inputs (the reference),
   recording every aten op with its output values, its source line (the
   user's frame: :mod:`graphrunner._frames`) and whether it ran in a graph
   segment or in an eager break (``@no_graph`` body);
4. puts back the step's writes again, and the runner's static input
   buffers, so the runner, its cache and the generators are as before.

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

import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from graphrunner._frames import is_internal, where
from graphrunner._pytree import flatten
from graphrunner.errors import CaptureError
from graphrunner.tape.state import storage_bytes

__all__ = ["CompareReport", "compare_runner"]

#: Aliasing ops: they compute nothing, and a graph drops or hoists them.
_SKIP = frozenset(("aten::detach", "aten::alias", "aten::view", "aten::_unsafe_view", "aten::as_strided",
                   "aten::t", "aten::transpose", "aten::permute", "aten::expand", "aten::slice", "aten::select",
                   "aten::unsqueeze", "aten::squeeze", "aten::reshape", "aten::lift_fresh",
                   # data movement: a graph adds copies (into survivors, eager-break results, its output
                   # buffer); a difference they carry shows in the next op that computes
                   "aten::copy_", "aten::clone", "aten::_to_copy",
                   # uninitialised memory
                   "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                   "aten::new_empty_strided"))


@dataclass
class _OpValue:
    op: str                       # overload packet, e.g. "aten.addmm"
    outs: Tuple[torch.Tensor, ...]
    where: Optional[Tuple[str, int, str]]
    context: str                  # "graph segment 1" / "eager break add_pos"

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
    output: Optional[str] = None
    op: Optional[str] = None
    where: Optional[Tuple[str, int, str]] = None
    op_diff: Optional[float] = None
    context: Optional[str] = None
    restored: List[str] = field(default_factory=list)

    @property
    def location(self) -> str:
        """``file:line`` of the first differing op (``"-"`` when unknown)."""
        return "-" if self.where is None else f"{self.where[0]}:{self.where[1]}"

    def __str__(self) -> str:
        head = f"bucket {self.bucket} (batch {self.batch})"
        if self.equal:
            return f"equal: the graph and eager PyTorch agree on {head}"
        text = (f"differ: on {head} the graph and eager PyTorch differ by up to {self.max_abs_diff:.6g} "
                f"(at {self.output})")
        if self.op is not None:
            text += (f"; the first op whose output differs is {self.op} at {where(self.where)} "
                     f"(max abs diff {self.op_diff:.6g}), in {self.context}")
        elif self.context is not None:
            text += f"; the difference starts in {self.context}"
        if self.context and self.context.startswith("eager break"):
            hint = ("the eager break reruns at every replay, but the Python code of the graph segments around it "
                    "ran only at capture: a value it reads that segment code sets (a Python attribute, a "
                    "counter) is the capture-time one. Pass it to the break as a tensor argument, or move the "
                    "code that sets it into the break")
        else:
            hint = ("the graph reads what it read at capture: a module tensor re-bound since (layer.weight = "
                    "nn.Parameter(...)), a resized cache or a Python number is stale. Update tensors in place "
                    "(.copy_()), or re-capture (runner.cleanup(); runner.capture()), or make the value an input")
        return f"{text}. Likely cause: {hint}. See docs/debugging.md"


class _Recorder(TorchDispatchMode):
    """Records ops (values, lines, context) and the storages they write."""

    def __init__(self, state: "_State", locate: bool):
        super().__init__()
        self.state, self.locate = state, locate
        self.ops: List[_OpValue] = []
        self.on = False
        self._segment = 1
        self._in_break = False

    def _context(self, frame) -> str:
        f, wrapper = frame, self.state.no_graph
        while f is not None:
            if f.f_code is wrapper:
                fn = f.f_locals.get("fn")
                self._in_break = True
                return f"eager break {getattr(fn, '__qualname__', fn)}"
            f = f.f_back
        if self._in_break:
            self._in_break = False
            self._segment += 1
        return f"graph segment {self._segment}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        state = self.state
        if self.on:
            state.note_seen(args, kwargs)
            state.note_writes(func, args, kwargs)
        out = func(*args, **kwargs)
        if not self.on:
            return out
        state.note_created(out)
        if func._schema.name in _SKIP:
            return out
        outs = tuple(t for t in _tensors(out))
        if not outs:
            return out
        with _disable_current_modes():
            vals = tuple(t.detach().clone() for t in outs)
        frame = sys._getframe(1)
        loc = _user_line(frame) if self.locate else None
        ctx = self._context(frame) if self.locate else ""
        self.ops.append(_OpValue(str(func.overloadpacket), vals, loc, ctx))
        return out


def _user_line(frame) -> Optional[Tuple[str, int, str]]:
    """The user's frame of an op of the step (not beyond :func:`compare_runner`)."""
    f = frame
    stop = compare_runner.__code__
    while f is not None and f.f_code is not stop:
        if not is_internal(f.f_code):
            return f.f_code.co_filename, f.f_lineno, f.f_code.co_name
        f = f.f_back
    return None


def _tensors(v):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _tensors(x)


def _key(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class _State:
    """What the two runs wrote, and how to put it back."""

    def __init__(self, inputs: List[torch.Tensor]):
        from graphrunner.drift import _no_graph_wrapper_code

        self.no_graph = _no_graph_wrapper_code()
        self.created: set = set()                       # storages made by the step
        self.seen: set = set()                          # storages an op read or wrote before
        self.inputs = {_key(t) for t in inputs}
        self.snapshots: Dict[int, Tuple[Any, torch.Tensor, str]] = {}
        self.gens = [(torch.default_generator, torch.default_generator.get_state())]

    def note_seen(self, args, kwargs) -> None:
        for v in list(args) + list(kwargs.values()):
            for t in _tensors(v):
                k = _key(t)
                if k is not None and k not in self.created:
                    self.seen.add(k)

    def note_created(self, out: Any) -> None:
        """Storages an op returned that no op had seen: made by the step (its
        writes to them are its own business, not state to put back)."""
        for t in _tensors(out):
            k = _key(t)
            if k is not None and k not in self.seen:
                self.created.add(k)

    def note_writes(self, func, args, kwargs) -> None:
        schema = func._schema
        if not schema.is_mutable:
            return
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(a.name)
            for t in _tensors(v if isinstance(v, (list, tuple)) else (v,)):
                k = _key(t)
                if k is None or k in self.created or k in self.inputs or k in self.snapshots:
                    continue
                st = t.untyped_storage()
                with _disable_current_modes(), torch.inference_mode():
                    raw = storage_bytes(st)
                    self.snapshots[k] = (st, raw.clone(), f"{tuple(t.shape)} {t.dtype}")

    def restore(self) -> None:
        with _disable_current_modes(), torch.inference_mode():
            for st, snap, _ in self.snapshots.values():
                storage_bytes(st).copy_(snap)
        for g, s in self.gens:
            g.set_state(s)


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


def _first_divergence(graph_ops: List[_OpValue], eager_ops: List[_OpValue], atol: float):
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


def _paths(out: Any) -> List[str]:
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


def compare_runner(runner: Any, inputs: Mapping[str, torch.Tensor], atol: float = 0.0) -> CompareReport:
    """Compare ``runner``'s graph with eager PyTorch on ``inputs``; see the module docstring.

    ``inputs`` are as for a call (every declared name, ``(n, *trailing)``).
    Raises :class:`CaptureError` before ``runner.capture()``, and
    ``ValueError`` when the batch falls back (no bucket replays it: there is
    no graph to compare). Outputs are compared on their real rows; ``atol``
    is the largest difference still called equal (default 0: the tape
    replays bit for bit).
    """
    if not runner.captured:
        raise CaptureError("runner.compare() needs a captured runner: call runner.capture() first")
    names = list(runner.inputs)
    missing = [k for k in names if k not in inputs]
    if missing or len(inputs) != len(names):
        raise ValueError(f"runner.compare(): expected exactly the inputs {names}, got {list(inputs)}")
    n = int(inputs[names[0]].shape[0])
    b = runner.bucket_for(n)
    if b is None or not runner.backend.can_run(b):
        raise ValueError(f"runner.compare(): batch {n} falls back to eager (no captured bucket replays it): "
                         "there is no graph to compare; pass a batch that fits a bucket")
    static = {k: v[:b] for k, v in runner.static_inputs.items()}
    saved_static = {k: v.clone() for k, v in runner.static_inputs.items()}
    padded = {}
    for name, spec in runner.inputs.items():
        t = torch.full((b, *spec.trailing), spec.pad, dtype=spec.dtype, device=runner.torch_device)
        t[:n].copy_(inputs[name])
        padded[name] = t
    state = _State(list(padded.values()) + list(static.values()))
    ctx = torch.inference_mode() if runner.inference_mode else torch.no_grad()
    try:
        # The graph first: it sees the Python state a call would see now (an
        # eager break reading a value the segment code set at capture).
        for name, t in padded.items():
            static[name].copy_(t)
        graph_rec = _Recorder(state, locate=False)
        with ctx, graph_rec:
            graph_rec.on = True
            result = runner.backend.replay(b)
            graph_rec.on = False
        _, graph_leaves = flatten(result)
        graph_out = [t.detach().clone() for t in graph_leaves]
        state.restore()
        eager_rec = _Recorder(state, locate=True)
        with ctx, eager_rec:
            eager_rec.on = True
            out = runner.step(**padded)
            _, leaves = flatten(out)
            eager_out = [torch.empty_like(t).copy_(t) for t in leaves]  # the graph copies into its buffer too
            eager_rec.on = False
    finally:
        state.restore()
        for k, v in runner.static_inputs.items():
            v.copy_(saved_static[k])
    paths = _paths(out)
    worst, at = 0.0, None
    for path, e, g in zip(paths, eager_out, graph_out):
        if e.dim() >= 1:
            e, g = e[:n], g[:n]
        d = _max_diff(e, g)
        if d > worst:
            worst, at = d, path
    report = CompareReport(equal=worst <= atol, bucket=b, batch=n, max_abs_diff=worst, output=at,
                           restored=[desc for _, _, desc in state.snapshots.values()])
    if report.equal:
        return report
    found = _first_divergence(graph_rec.ops, eager_rec.ops, atol)
    if found is not None:
        e, d = found
        report.op, report.where, report.op_diff, report.context = e.op, e.where, d, e.context
    return report
