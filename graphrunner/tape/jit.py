"""Replay through a TorchScript trace of the generated code.

Owns the second replay engine.  The generated replay
(:mod:`~graphrunner.tape.codegen`) is straight-line Python: each op costs a
Python call and the binding's argument parsing on top of its kernel.  The
TorchScript interpreter runs the same aten calls without either, so a
decode step replays 5-25% faster through it (``bench/tape_vs_eager.py``).

:class:`JitReplay` wraps the generated program.  It traces
(``torch.jit.trace``) a copy of the replay that takes every tensor it binds
as a parameter, the tensors inside list constants included, so the trace
holds no tensor constant and no value of the capture is frozen into it.
Calls run the trace without TorchScript's optimisation passes
(``torch.jit.optimized_execution(False)``): the recorded aten calls, in
order, on the same tensors, so the results are bit-identical to the Python
replay's.

The trace is made at capture end (:meth:`JitReplay.prepare`, called by
``TapeGraph.capture_end``), so that the first replay costs what a steady
one does: tracing takes milliseconds, and the trace's first call builds
TorchScript's execution plan.  Tracing executes the replay once, and
``prepare`` runs the trace once more to build that plan; both leave no
trace, as a CUDA capture launches nothing: the bytes of every storage the
replay writes (the external tensors it writes, the graph's survivors, pool
memory it spills to) are copied first and put back after (the same
rollback a failed trace uses), and the generators the replay draws from
get their states back.  Inside :func:`traces_at_first_replay` (a caller that replays
every graph right after capturing it) the capture end does neither: the
first replay traces, as below.  ``prepare`` runs with the caller's dispatch modes
disabled.  Only when the graph cannot be traced at capture end (its pool is
replaying in another thread, or its capture drew from stand-in generators
under a :func:`~graphrunner.tape.rng.redirect`, whose trace would draw from
the engine's own generators) is the trace made at the first replay
(``engine == "jit-pending"`` until then): that replay traces, and tracing
*is* the replay.

Within a capture session (:func:`~graphrunner.tape.state.reuse_snapshot_buffers`) a graph whose
traced program is another's but for the sizes of the tensors it binds (the same source text, so the
same calls with the same literals; the same non-tensor bindings; per tensor the same type, dtype,
device, rank, ``requires_grad`` and aliasing: :func:`_share_key`) replays through that graph's trace instead of
tracing its own (``JitReplay.shared``): the trace records each call of the text as the aten op it
dispatches, with the text's literals, so it runs this program's calls on this graph's tensors; a trace
made with a ``TracerWarning`` (a value the trace may have frozen) is never shared. Keys of one runner
that differ only in a dim the text does not show (a KV length, carried by the externals' shapes) share
it. Its first run here is guarded as a trace's first run is (written externals put back and the Python
replay run, should it raise).

A graph replays in Python instead when its program replays fewer than
:data:`JIT_MIN_OPS` ops (the Python replay is faster there), when it is not eligible
(:func:`eligible`: collectives, or a bound value other than tensors,
literals and C builtins such as torch's functions: a generator, a Python
function), when tracing fails (the external tensors the replay writes are
restored from the copy taken before; at the first replay the Python replay
then runs, so no write happens twice), or when the trace came out with a
tensor constant.  A replay made while a ``TorchDispatchMode`` is active
(``runner.compare`` records the ops it runs) runs the Python replay, so
that the mode sees every op, and is never the one traced.
``TapeGraph(jit_replay=False)`` or the environment variable
``GRAPHRUNNER_TAPE_JIT=0`` turns the engine off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .codegen import compiled_source
from .state import in_session, on_session_end, release_snapshot, snapshot_copy, storage_bytes

logger = logging.getLogger("graphrunner.tape")

#: Set to ``0`` to replay every TapeGraph in Python (the default is the trace).
JIT_ENV_VAR = "GRAPHRUNNER_TAPE_JIT"

#: Programs replaying fewer ops than this replay in Python, untraced.  The trace's
#: call has a fixed cost of its own (the argument tuple, the executor's entry) and
#: saves about a quarter of the Python replay's cost per op: measured on one
#: thread (2-64 element-wise ops, 1-8 linear + ReLU layers), the Python replay is
#: faster below about 8-12 ops (by 1-4 us), the trace from there on, by more the
#: bigger the program.  Not tracing a small program also spares its capture end
#: the trace and the trace's first run.
JIT_MIN_OPS = 10

_get_optimize = torch._C._get_graph_executor_optimize
_set_optimize = torch._C._set_graph_executor_optimize

_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_LITERAL_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


class _AtFirstReplay(threading.local):
    depth = 0


_AT_FIRST_REPLAY = _AtFirstReplay()


@contextlib.contextmanager
def traces_at_first_replay() -> Iterator[None]:
    """Inside the block (this thread), a graph captured is not traced at its capture end but at its
    first replay (``engine == "jit-pending"`` until then; :meth:`JitReplay._first`, the path a graph
    whose pool was replaying at capture end takes): tracing runs the replay once, so that replay *is*
    the trace's run, guarded as always (the written externals copied first and put back should
    tracing fail, then the Python replay). For a caller that replays every graph right after
    capturing it (``gr.hf``'s equivalence check): the capture end does not run each program twice
    (the trace and the run building its execution plan) and put back what they wrote; the second
    replay builds the plan. (The caller may run those first replays inside
    :func:`~graphrunner.tape.state.reuse_snapshot_buffers`, for the copies they take.)"""
    _AT_FIRST_REPLAY.depth += 1
    try:
        yield
    finally:
        _AT_FIRST_REPLAY.depth -= 1


def traced_at_first_replay() -> bool:
    """Whether a graph captured now (this thread) is traced at its first replay (:func:`traces_at_first_replay`)."""
    return _AT_FIRST_REPLAY.depth > 0


def jit_default() -> bool:
    """Whether TapeGraphs replay through a trace unless told: ``GRAPHRUNNER_TAPE_JIT`` is not ``0``."""
    return os.environ.get(JIT_ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def _torch_callable(v) -> bool:
    """A builtin of a C extension (torch's functions, Tensor methods, an aten op's ``_op``): never Python code."""
    return type(v).__name__ in ("builtin_function_or_method", "method_descriptor")


def _plain_tensor(v) -> bool:
    return type(v) in _TENSOR_TYPES


def eligible(env: dict, collective: bool) -> str | None:
    """None if a program binding ``env`` can be traced, else why not.  A
    generator (an RNG op drawing from a given one) is not a value a trace
    takes, so such programs replay in Python; RNG ops on the default
    generator draw from it at each replay either way."""
    if collective:
        return "it issues collectives"
    for name, v in env.items():
        if _plain_tensor(v) or isinstance(v, _LITERAL_TYPES):
            continue
        if isinstance(v, (list, tuple)) and all(_plain_tensor(x) or isinstance(x, _LITERAL_TYPES) for x in v):
            continue
        if callable(v) and _torch_callable(v):
            continue
        return f"it binds {name} = {type(v).__name__}"
    return None


class JitReplay:
    """The replay of one program through a TorchScript trace (see the module
    docstring).  Call it where the Python replay ``fn`` would be called
    (under the replay's grad / inference mode); ``engine`` says which ran
    last: ``"jit"``, ``"jit-pending"`` (not traced yet: :meth:`prepare` did
    not run at capture end, so the first replay traces) or ``"python"``."""

    def __init__(self, fn: Callable[[], None], lines: list[str], env: dict, written: list[torch.Tensor]):
        self._python = fn
        self._written = written
        self._trace: Any = None
        self.engine = "jit-pending"
        self.why_python: str | None = None
        params: list[str] = []
        args: list[torch.Tensor] = []
        glob: dict[str, Any] = {}
        inline: dict[str, str] = {}
        for name, v in env.items():
            if _plain_tensor(v):
                params.append(name)
                args.append(v)
            elif isinstance(v, (list, tuple)) and any(_plain_tensor(x) for x in v):
                parts = []
                for j, x in enumerate(v):
                    if _plain_tensor(x):
                        params.append(f"{name}_{j}")
                        args.append(x)
                        parts.append(f"{name}_{j}")
                    else:
                        parts.append(f"_lit_{name}_{j}")
                        glob[f"_lit_{name}_{j}"] = x
                inline[name] = (
                    ("[" + ", ".join(parts) + "]")
                    if isinstance(v, list)
                    else ("(" + "".join(p + ", " for p in parts) + ")")
                )
            else:
                glob[name] = v
        body = list(lines) or ["pass"]
        if inline:
            pat = re.compile(r"\b(" + "|".join(map(re.escape, inline)) + r")\b")
            body = [pat.sub(lambda m: inline[m.group(1)], ln) for ln in body]
        # The trace needs an output: the first tensor parameter (every op that
        # writes a parameter is kept, since parameters may alias each other).
        ret = params[0] if params else "None"
        src = (
            f"def _replay_traced({', '.join(params)}):\n"
            + "\n".join("    " + ln for ln in body)
            + f"\n    return {ret}\n"
        )
        self.source = src
        self._args = tuple(args)
        self._shared_as = _share_key(src, glob, self._args)
        glob["__name__"] = __name__
        exec(compiled_source(src, "<tape replay (traced)>"), glob)
        self._fn = glob["_replay_traced"]
        self._fn.__module__ = __name__
        #: Whether the trace was made for another graph of equal text and bindings (:func:`_share_key`).
        self.shared = False

    def __call__(self) -> None:
        if torch._C._len_torch_dispatch_stack():
            # a dispatch mode is watching (runner.compare, a user's mode): it
            # sees the generated code's calls one by one; nothing is traced
            # under it
            self._python()
            return
        trace = self._trace
        if trace is not None:
            # torch.jit.optimized_execution(False) without its context manager (a generator,
            # about a microsecond per call): the flag off for the call, put back after
            if _get_optimize():
                _set_optimize(False)
                try:
                    trace(*self._args)
                finally:
                    _set_optimize(True)
            else:
                trace(*self._args)
            return
        if self.engine == "python":
            self._python()
            return
        self._first()

    def prepare(self, keep: list[torch.Tensor], generators: list) -> None:
        """Trace now, at capture end, and run the trace once more so that its
        first call at replay finds TorchScript's execution plan built; leave
        no trace of either run: the storages of the written externals and of
        ``keep`` (the graph's survivors, the pool memory it spills to) get
        their bytes back, and ``generators`` their states.  Falls back to the
        Python replay (``engine == "python"``) when tracing fails or the trace
        holds a tensor constant.  Call it where a replay would run (the
        replay's grad / inference mode, torch-function handling off, the
        pool's replay lock held) with no dispatch mode active."""
        saved = _snapshot(list(self._written) + list(keep))
        states = [(g, g.get_state()) for g in generators]
        try:
            trace = self._shared_trace()
            if trace is None:
                trace = self._make_trace()
            why = _tensor_constants(trace)
            if why is None:
                with torch.jit.optimized_execution(False):
                    trace(*self._args)  # builds the execution plan the first replay would
        except Exception as exc:  # noqa: BLE001 - the Python replay is always there
            why = f"tracing failed: {type(exc).__name__}: {str(exc)[:200]}"
        finally:
            _restore(saved)
            for g, state in states:
                g.set_state(state)
        del saved
        if why is not None:
            self._fallback(why)
            return
        self._trace = trace
        self.engine = "jit"

    def _first(self) -> None:
        """Trace at the first replay (only when :meth:`prepare` could not run
        at capture end): tracing runs the replay once, so it *is* this replay;
        or fall back to the Python replay with the written externals
        restored."""
        saved = _snapshot(self._written)
        try:
            trace = self._shared_trace()
            if trace is not None:  # this replay runs it (tracing ran the program; running it is the replay)
                with torch.jit.optimized_execution(False):
                    trace(*self._args)
            else:
                trace = self._make_trace()
        except Exception as exc:  # noqa: BLE001 - the Python replay is always there
            _restore(saved)
            self._fallback(f"tracing failed: {type(exc).__name__}: {str(exc)[:200]}")
            self._python()
            return
        _release(saved)
        why = _tensor_constants(trace)
        if why is not None:  # this replay ran for real; later ones must not read a frozen value
            self._fallback(why)
            return
        self._trace = trace
        self.engine = "jit"

    def _make_trace(self):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", torch.jit.TracerWarning)
            warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates torch.jit.trace
            trace = torch.jit.trace(self._fn, self._args, check_trace=False)
        # a trace made with a TracerWarning (a value read on the host, ...) may hold this graph's shapes:
        # never given to another
        if (
            self._shared_as is not None
            and in_session()
            and not any(issubclass(w.category, torch.jit.TracerWarning) for w in seen)
        ):
            _SHARED.setdefault(self._shared_as, trace)
        return trace

    def _shared_trace(self):
        """The trace of an earlier graph of this session whose program is this one's but for the sizes of
        the tensors it binds (:func:`_share_key`), or None."""
        if self._shared_as is None or not in_session():
            return None
        trace = _SHARED.get(self._shared_as)
        self.shared = trace is not None
        return trace

    def _fallback(self, why: str) -> None:
        self.engine = "python"
        self.why_python = why
        logger.debug("tape replay in Python: %s", why)


# Traces within a capture session, by _share_key: a graph whose program is another's but for the sizes
# of the tensors it binds replays through that graph's trace (JitReplay.shared). Emptied when the
# outermost session exits.
_SHARED: dict = {}
on_session_end(_SHARED.clear)


def _share_key(src: str, glob: dict, args: tuple) -> tuple | None:
    """What makes two graphs' traces interchangeable: the traced source text, every non-tensor value it
    binds (C callables by identity, literals by type and ``repr``) and, per tensor parameter, its type,
    dtype, device, rank, ``requires_grad`` and the first parameter on its storage (their aliasing);
    not its sizes or strides. The text holds every size the
    program passes (a view's, a factory's) as a literal, and the trace records each call of the text as
    the aten op it dispatches, with those literals: a trace of the one program runs the other's calls
    on its tensors. ``None`` for a binding it cannot describe so (nothing shared)."""
    vals = []
    for name, v in glob.items():
        if isinstance(v, _LITERAL_TYPES):
            vals.append((name, type(v).__name__, repr(v)))
        elif _torch_callable(v):
            vals.append((name, "C", v))
        else:
            return None
    first: dict[int, int] = {}  # storage -> the first parameter on it: the parameters' aliasing too
    tensors = tuple(
        (type(t), t.dtype, t.device, t.dim(), t.requires_grad, first.setdefault(_storage_ptr(t), i))
        for i, t in enumerate(args)
    )
    return (src, tuple(vals), tensors)


def _storage_ptr(t: torch.Tensor) -> int:
    st = t.untyped_storage()
    return st.data_ptr() if st.nbytes() else -1 - id(t)  # (an empty storage aliases nothing)


def _tensor_constants(trace) -> str | None:
    """Why a trace cannot be used (it froze a tensor into a constant), or None."""
    consts = [n for n in trace.graph.findAllNodes("prim::Constant") if n.output().type().kind() == "TensorType"]
    return f"the trace holds {len(consts)} tensor constant(s)" if consts else None


def _snapshot(tensors: list[torch.Tensor]) -> list:
    out, seen = [], set()
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() in seen or st.nbytes() == 0:
            continue
        seen.add(st.data_ptr())
        with torch.inference_mode():
            out.append((st, snapshot_copy(storage_bytes(st))))
    return out


def _release(saved: list) -> None:
    """Give back the copies of a :func:`_snapshot` that is not restored."""
    for _, copy in saved:
        release_snapshot(copy)


def _restore(saved: list) -> None:
    with torch.inference_mode():
        for st, copy in saved:
            storage_bytes(st).copy_(copy)
            release_snapshot(copy)
