"""TapeGraph: a CUDA graph you can run on a CPU.

A :class:`TapeGraph` records every aten op that runs during capture (through a
``TorchDispatchMode``) and replays the recorded ops against the same tensors.
It mirrors ``torch.cuda.CUDAGraph`` closely enough that capture code written for
one runs on the other:

* Tensors not produced inside the capture are *external* (static inputs,
  weights, KV cache); replay reads and writes them in place.  Writes to
  externals made while capturing are undone at capture end, because a CUDA
  capture launches nothing.
* Python control flow, Python scalars and shapes are frozen at capture.
* Tensors produced inside the capture that are still referenced after it
  (*survivors*: returned, stored on an object, ...) keep their identity and are
  refreshed in place at every replay; everything else is a temporary.
* Host-synchronising and data-dependent-shape operations raise
  :class:`~graphrunner.errors.CaptureUnsafeOpError` during capture.
* RNG as on CUDA: a capture consumes nothing from any generator (the default
  CPU generator and every generator the capture drew from get their state
  back at capture end); each replay draws what the eager step would draw from
  the generator's current state.  Re-seeding (``torch.manual_seed``, ...)
  during capture raises :class:`~graphrunner.errors.CaptureError`.  An empty
  capture warns (:data:`EMPTY_GRAPH_MESSAGE`).
* Collectives (``c10d`` ops) are re-issued and waited on.  Functional collectives (``_c10d_functional``:
  ``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ... then ``wait_tensor``) are
  re-issued at replay on the recorded group in recorded order, and their results are read (refreshed,
  their input buffers reused) only after their ``wait_tensor``, or at the end of the replay when the
  capture never waited.  An op on a DTensor is never recorded: DTensor's own dispatch runs once, with the
  recorder active, and the plain-tensor ops it issues (the local op, its redistributions' collectives) are
  recorded; ops DTensor runs on fake tensors (sharding propagation) are not.  Ops on other tensor
  subclasses are refused at capture (:class:`~graphrunner.errors.CaptureError` naming the op).
* Graphs captured into one pool (``pool=``) share its memory as on CUDA: a
  later capture reuses memory freed after an earlier one (including
  outputs the user dropped), so out-of-order replays corrupt as on a GPU;
  concurrent replays in one pool raise (:mod:`~graphrunner.tape.pool`).
* Optionally (``TapeGraph(poison_captured_values=True)``, or the environment
  variable ``GRAPHRUNNER_TAPE_POISON=1``), survivors are filled with a poison
  value at capture end (NaN, the integer dtype's max, ``True``), because on a
  CUDA graph they hold uninitialised pool memory until the first replay: code
  that reads them between capture and replay (an eager break, a check of the
  capture-time output) then fails on CPU as it would on the GPU.
* Replay runs straight-line Python generated once at ``capture_end``, or a
  TorchScript trace of it, also made at ``capture_end`` so that the first
  replay costs what a steady one does (the same aten calls in the same
  order, bit-identical, without Python's per-op cost; making the trace runs
  the replay once and leaves nothing behind: :mod:`~graphrunner.tape.jit`;
  ``TapeGraph(jit_replay=False)`` or ``GRAPHRUNNER_TAPE_JIT=0`` keeps the
  Python, as does a program of fewer than ``jit.JIT_MIN_OPS`` ops, faster in Python); it never goes through a
  dispatch mode of its own.  To make it cheap: views of externals and
  constant factories are hoisted (computed once); each op calls the public
  binding (``torch.mul``, ``Tensor.view``, ...) verified at capture to match
  the aten op bit for bit, with Python scalars as shared 0-dim tensors; views
  with their input's exact metadata are dropped; a ``matmul`` into a
  preplanned buffer calls the ``mm`` / ``bmm`` kernel it reaches directly,
  on the same views (every such rewrite kept only when proven to leave the
  same bits as the call it replaces, on the capture's data and on random
  data: :mod:`~graphrunner.tape.proof`); a pure op repeating an
  earlier one on unchanged inputs reuses its result (CSE); dead ops are
  dropped.  Torch-function handling is disabled during replay, so no mode or
  tensor subclass intercepts the bindings (the recorded aten ops never saw one
  either).

Limits (as on a CUDA graph, the graph holds tensors, not names): ``resize_``,
``set_``, or re-assigning a module attribute / cache tensor after capture
silently invalidates the graph; re-capture after such a change.

Modules (each owns one job; see its docstring):

* :mod:`~graphrunner.tape.graph`: :class:`TapeGraph`, :func:`tape_graph`,
  :class:`TapePool`: the life cycle of a graph;
* :mod:`~graphrunner.tape.recording`: the capture in progress and the
  dispatch-mode recorder;
* :mod:`~graphrunner.tape.unsafe`: the capture-unsafe op catalogue;
* :mod:`~graphrunner.tape.rng`: generators with CUDA's semantics;
* :mod:`~graphrunner.tape.survivors`: survivors, escaped-tensor warnings
  (a survivor written from outside its graph; one kept on an attribute and
  not returned, named) and poison;
* :mod:`~graphrunner.tape.bindings`: public bindings verified against the
  aten ops, for replay;
* :mod:`~graphrunner.tape.codegen`: hoisting, CSE, dead-code elimination
  and the generated replay function;
* :mod:`~graphrunner.tape.collapse`: composite calls (``matmul``, biased
  ``linear``) replayed as the one kernel they reach (``mm`` / ``bmm`` /
  ``addmm`` with ``out=``);
* :mod:`~graphrunner.tape.proof`: the one gate of every rewrite (the
  same bits as the replaced call on the capture's data and on random
  data, or the rewrite is dropped);
* :mod:`~graphrunner.tape.jit`: the TorchScript replay engine (the
  generated code traced at capture end);
* :mod:`~graphrunner.tape.pool`: :class:`TapePool` and the per-pool arena
  (memory reuse between captures as on CUDA, the pool size estimate);
* :mod:`~graphrunner.tape.state`: the captures in progress, per thread, and
  the tensors the tape itself holds;
* :mod:`~graphrunner.tape.streams`: streams and events (``torch.cuda``'s
  API), their ordering rules as vector clocks, and the deferred writes of a
  side stream until it is joined (the emulation of an unjoined stream).

Layering (bottom up; a module imports only modules below it, each from its own
module (``from .state import ...``), never a name from this package, so that
importing any one of them runs no cycle; ``tests/test_layers.py`` checks it):
:mod:`~graphrunner.tape.state` -> :mod:`~graphrunner.tape.survivors`,
:mod:`~graphrunner.tape.unsafe`, :mod:`~graphrunner.tape.streams` ->
:mod:`~graphrunner.tape.proof`, :mod:`~graphrunner.tape.rng` ->
:mod:`~graphrunner.tape.bindings` -> :mod:`~graphrunner.tape.collapse` ->
:mod:`~graphrunner.tape.recording` -> :mod:`~graphrunner.tape.codegen`,
:mod:`~graphrunner.tape.jit`, :mod:`~graphrunner.tape.pool` ->
:mod:`~graphrunner.tape.graph` -> this package's ``__init__``.  A lower module
that handles a capture in progress knows it as a protocol of its own
(``state.ActiveCapture``, ``bindings.VerifiedCapture``), not by importing the
recorder's ``TapeCapture``.
"""

from .graph import EMPTY_GRAPH_MESSAGE, TapeGraph, tape_graph
from .pool import TapePool, graph_pool_handle
from .state import is_tape_capturing
from .streams import TapeEvent, TapeStream
from .survivors import (
    POISON_ENV_VAR,
    EscapedTensorWarning,
    StashedTensorWarning,
    poison_default,
    poison_value,
)

__all__ = [
    "TapeGraph",
    "TapeStream",
    "TapeEvent",
    "POISON_ENV_VAR",
    "poison_default",
    "poison_value",
    "TapePool",
    "tape_graph",
    "graph_pool_handle",
    "is_tape_capturing",
    "EscapedTensorWarning",
    "StashedTensorWarning",
    "EMPTY_GRAPH_MESSAGE",
]
