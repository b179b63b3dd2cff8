"""GraphRunner: everything between "here is a batch" and "here are the outputs".

::

    runner = gr.GraphRunner(step, inputs={"x": gr.BatchInput(trailing=(64,))}, buckets=[1, 2, 4, 8])
    print(runner.capture())          # largest bucket first; a CaptureReport table
    y = runner(x=torch.randn(3, 64))  # copy into static buffers, pad to 4, replay, slice to 3 rows

The runner is a facade over two parts built from its arguments: the server
(:mod:`graphrunner.serving`: a call, and the state it owns: static inputs, output layout,
routes, agreement across ranks, statistics) and the capturer (:mod:`graphrunner.capturing`:
a capture, with its checks as capture hooks, memory budget and background capture), over the
backend that owns the capture protocol (:mod:`graphrunner.backends`). The parts talk through
their own methods; the facade only forwards. See ``docs/runner.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from graphrunner.agreement import config_fields
from graphrunner.backends import make_backend
from graphrunner.background import capture_in_background, hold_background, wait_captured
from graphrunner.buckets import default_buckets
from graphrunner.budget import MemoryBudget
from graphrunner.capturing import Capturer
from graphrunner.checks import contracts, resolve_checks
from graphrunner.checks.compare import compare_runner
from graphrunner.checks.verify import verify_every_setting
from graphrunner.errors import CaptureError
from graphrunner.group import LocalGroup
from graphrunner.inputs import BatchInput, check_config, check_step, positional_error
from graphrunner.keys import (
    BATCH_DIM,
    Batch,
    Buckets,
    Group,
    Key,
    KeySpace,
    OutputDims,
    resolve_input_dims,
    resolve_output_dims,
)
from graphrunner.layout import OutputLayout
from graphrunner.pacing import check_share
from graphrunner.report import CaptureReport, RunnerStats
from graphrunner.serving import Server
from graphrunner.staging import StaticInputs

if TYPE_CHECKING:
    from graphrunner.arena import OutputArena
    from graphrunner.checks.compare import CompareReport
    from graphrunner.dispatch import ReplayBackend
    from graphrunner.trace import Trace

__all__ = ["GraphRunner", "BatchInput", "RunnerStats", "default_buckets"]

logger = logging.getLogger("graphrunner")


def _part_attr(part: str, name: str, doc: str, read_only: bool = False) -> property:
    """A runner attribute that is the ``name`` attribute of its ``part`` (``"server"`` or
    ``"capturer"``), which owns it."""

    def get(self: GraphRunner) -> Any:
        return getattr(getattr(self, part), name)

    def put(self: GraphRunner, value: Any) -> None:
        setattr(getattr(self, part), name, value)

    return property(get, None if read_only else put, doc=doc)


class GraphRunner:
    """Capture ``step`` once per key (batch bucket) and serve calls by replay.

    Args:
        step: ``step(**static_inputs) -> output``, called with one keyword per
            declared input. It must only read its inputs, be row-independent
            (padding must not change real rows: the padding check measures
            it), and return a pytree of tensors whose declared leading dims
            are the key's sizes (0-dim tensors are returned whole).
        inputs: ``{name: BatchInput(...)}``: the keywords of ``step`` and of every call.
        buckets: strictly increasing sizes (``[1, 2, 4, 8]``, one batch dim, int
            keys) or ``{dim: [sizes...]}`` (tuple keys in the dict's order);
            see :mod:`graphrunner.keys`.
        backend: ``"breakable"`` (default), ``"full"``, ``"eager"``, or a backend
            instance (then configure ``device``, ``group``, ``warmups`` and
            ``trace`` on it, not here).
        device, group, warmups, trace: the named backend's device (static buffers live on
            its ``torch_device``), rank group (with more than one rank every call agrees on
            the key), eager warmup forwards per key, and :class:`~graphrunner.Trace`.
        post_warmup_hook: ``hook(bucket)`` after each warmup forward of a key (e.g. reset a KV
            cache the warmup wrote); the padding check calls it after its own forward too.
        max_padding_ratio: ``None`` or a float in ``[0, 1)``: a call whose padding
            would exceed this share of the key falls back.
        fallback: ``"eager"`` (run ``step`` eagerly when no key fits) or ``"error"``.
        keys: ``None`` (every combination of buckets) or the keys to capture.
        outputs: the leading dims of the outputs (a dims tuple, or ``{key: dims}``
            for a dict output); default: the first input's dims.
        checks: the capture-time checks (:mod:`graphrunner.checks`); ``None`` means
            :data:`~graphrunner.checks.DEFAULT_CHECKS` = ``("drift", "padding", "fingerprint")``;
            ``gr.PaddingCheck(exempt=...)`` configures the padding check; ``()`` runs none.
        debug: debug mode (``None`` reads ``GRAPHRUNNER_DEBUG=1``): every call
            checks ``BatchInput(bounds=...)`` and, before each replay, that the
            tensors the graph reads keep their storage (:mod:`graphrunner.checks.contracts`);
            it verifies every call (``verify_every=1``) unless told otherwise.
        verify_every: shadow verification: every N-th replayed call also runs
            eagerly on the same padded inputs and must agree (``ContractError``
            otherwise; :mod:`graphrunner.checks.verify`). ``None`` reads
            ``GRAPHRUNNER_VERIFY_EVERY``; 0 is off (the default outside debug mode).
        copy_outputs: return clones instead of views of the static output buffer
            (default ``False``, ``True`` with an ``output_arena``); per call: :meth:`run`.
        output_arena: a :class:`~graphrunner.OutputArena` shared with other runners
            of the same model (one output memory, the max over runners).
        progress: draw a capture progress bar on rank 0 (stderr).
        memory_budget: bytes the graph pool may hold (one rank): keys left out go eager (:mod:`graphrunner.budget`).
            A device object given with a budget lends the runner a pool of its own (``device.with_own_pool()``).

    Configuration errors raise ``ValueError``/``TypeError`` here, before any capture. **Outputs
    are views** of the backend's one output buffer: the next call overwrites them (clone, or
    ``copy_outputs=True``). **Multi-rank**: each call makes exactly one collective
    (:mod:`graphrunner.agreement`) and all ranks replay the same key, fall back together, or
    raise together (an idle rank, 0 rows, joins them); :meth:`capture` compares the ranks'
    configurations first. ``runner.agree_bucket = False`` before :meth:`capture` turns
    agreement off (UNSAFE, tests only). The full contract: ``docs/runner.md``.
    """

    #: Agree the key across ranks on every call (set False before capture() only in tests: UNSAFE).
    agree_bucket = True

    def __init__(
        self,
        step: Callable[..., Any],
        inputs: Mapping[str, BatchInput],
        buckets: Buckets,
        backend: Any = "breakable",
        device: Any = "auto",
        group: Group | None = None,
        warmups: int = 2,
        post_warmup_hook: Callable[[Any], Any] | None = None,
        max_padding_ratio: float | None = None,
        fallback: str = "eager",
        trace: Trace | None = None,
        *,
        keys: Sequence[Key] | None = None,
        outputs: OutputDims = None,
        checks: Any = None,
        debug: bool | None = None,
        verify_every: int | None = None,
        memory_budget: int | None = None,
        copy_outputs: bool | None = None,
        output_arena: OutputArena | None = None,
        progress: bool = True,
    ) -> None:
        check_config(step, inputs, fallback, post_warmup_hook, output_arena)
        space = KeySpace(buckets, keys=keys, max_padding_ratio=max_padding_ratio)
        # The public keys and buckets below take the form the caller chose with ``buckets=`` (ints and a
        # list, or tuples and a dict), which the caller knows: ``Any``, not a union every caller would
        # have to narrow again (``Key`` and ``Buckets`` in graphrunner.keys name both forms).
        #: ``buckets`` as given: a list (one dim, int keys) or ``{dim: [sizes...]}`` (tuple keys).
        self.buckets: Any = (
            space.buckets[BATCH_DIM] if space.one_batch_dim else {d: list(v) for d, v in space.buckets.items()}
        )
        #: The runner's dim names, in key order (``("batch",)`` with ``buckets=[...]``).
        self.dims: tuple[str, ...] = space.dims
        #: Every key captured, smallest first (ints with ``buckets=[...]``, else tuples).
        self.keys: list[Any] = [space.external(k) for k in space.keys]
        self.max_padding_ratio = space.max_padding_ratio
        #: The largest bucket of the first dim (the batch with ``buckets=[...]``).
        self.max_batch = space.maxes[0]
        checks_set = resolve_checks(checks)
        debug = contracts.debug_enabled(debug)
        self.inputs, self.output_arena = dict(inputs), output_arena
        made = make_backend(
            backend,
            device=device,
            group=group,
            warmups=warmups,
            trace=trace,
            drift_check=None if checks is None else checks_set.drift,
            output_arena=output_arena,
            own_pool=memory_budget is not None,
        )
        #: The backend (a :class:`~graphrunner.backends.base.GraphBackend`, or an instance given that
        #: has its methods); the capturer captures with it, the server replays it.
        self.backend: ReplayBackend = made
        if checks is None:  # the default set: the drift check is the backend's own setting
            checks_set = dataclasses.replace(checks_set, drift=bool(getattr(made, "drift_check", True)))
        #: The backend's device object (any object with the device methods, :mod:`graphrunner.devices`).
        self.device: Any = made.device
        self.group: Group = getattr(made, "group", None) or LocalGroup()
        self.rank, self.world_size = int(getattr(self.group, "rank", 0)), int(getattr(self.group, "size", 1))
        self.torch_device = torch.device(getattr(self.device, "torch_device", torch.device("cpu")))
        in_dims = resolve_input_dims(inputs, space)
        key_text = functools.partial(_key_text, space)
        staging = StaticInputs(
            specs=inputs,
            in_dims=in_dims,
            dims=space.dims,
            maxes=space.maxes,
            one_batch_dim=space.one_batch_dim,
            device=self.torch_device,
        )
        layout = OutputLayout(
            out_dims=resolve_output_dims(outputs, in_dims[next(iter(inputs))], space),
            dims=space.dims,
            one_batch_dim=space.one_batch_dim,
            key_text=key_text,
        )
        # views into a shared arena are overwritten by any runner on it: copies unless asked otherwise
        copy = (output_arena is not None) if copy_outputs is None else bool(copy_outputs)
        #: The server part (:class:`graphrunner.serving.Server`): a call and the state it owns.
        self.server = Server(
            step=step,
            space=space,
            inputs=staging,
            layout=layout,
            backend=self.backend,
            group=self.group,
            fallback=fallback,
            debug=debug,
            verify_every=verify_every_setting(verify_every, debug),
            copy_outputs=copy,
            key_text=key_text,
        )
        #: The capturer part (:class:`graphrunner.capturing.Capturer`): a capture, its checks and budget.
        self.capturer = Capturer(
            server=self.server,
            backend=self.backend,
            checks=checks_set,
            post_warmup_hook=post_warmup_hook,
            progress=progress,
            memory_budget=MemoryBudget(memory_budget, world_size=self.world_size),
            output_arena=output_arena,
        )

    # ----------------------------------------------------------- the parts' settings, as attributes
    step = _part_attr("server", "step", "The step (``step(**static_inputs)``).")
    fallback = _part_attr("server", "fallback", '``"eager"`` or ``"error"``: what a call no key serves does.', True)
    debug = _part_attr(
        "server",
        "debug",
        "Debug mode (``debug=`` or ``GRAPHRUNNER_DEBUG=1``): see :mod:`graphrunner.checks.contracts`.",
        True,
    )
    verify_every = _part_attr(
        "server",
        "verify_every",
        "Shadow verification of every N-th replayed call (0: off; :mod:`graphrunner.checks.verify`).",
        True,
    )
    copy_outputs = _part_attr("server", "copy_outputs", "Return clones instead of views by default.")
    stats = _part_attr("server", "stats", "Per-call statistics (:class:`~graphrunner.report.RunnerStats`).", True)
    checks = _part_attr(
        "capturer", "checks", "The checks run at capture (:class:`~graphrunner.checks.CheckSet`).", True
    )
    post_warmup_hook = _part_attr("capturer", "post_warmup_hook", "``hook(key)`` after each warmup forward.")
    progress = _part_attr("capturer", "progress", "Draw a capture progress bar on rank 0.")
    report = _part_attr("capturer", "report", "The last capture's :class:`CaptureReport` (``None`` before one).", True)

    @property
    def captured(self) -> bool:
        """True after a successful :meth:`capture` (until :meth:`cleanup`)."""
        return self.server.serving

    @property
    def static_inputs(self) -> dict[str, torch.Tensor]:
        """The static input buffers ``{name: (*largest key on its dims, *trailing)}``; do not write them."""
        return dict(self.server.inputs.buffers)

    def bucket_for(self, batch: Batch) -> Any:
        """The key a local call of ``batch`` replays, or ``None`` if it falls back. A 0 in some dim
        replays the key covering a 1 there, as a call does, unless the call runs no step (every
        output empty: ``None``), which is known after :meth:`capture` (``None`` before). Ignores
        agreement and whether the key was captured. ``batch``: an int with ``buckets=[...]``, else a
        tuple of sizes in :attr:`dims` order or ``{dim: size}``."""
        return self.server.key_for(batch)

    key_for = bucket_for

    def __repr__(self) -> str:
        return (
            f"GraphRunner(backend={getattr(self.backend, 'name', type(self.backend).__name__)!r}, buckets="
            f"{self.buckets}, inputs={list(self.inputs)}, rank={self.rank}/{self.world_size}, "
            f"captured={self.captured})"
        )

    def _config_fields(self) -> dict[str, Any]:
        """What every rank must configure alike (:func:`graphrunner.agreement.config_fields`)."""
        return config_fields(self.server, self.capturer.checks)

    # -------------------------------------------------------------- capture
    def capture(self, background: bool = False, share: float = 1.0) -> CaptureReport | None:
        """Capture every key, largest first, inside one ``backend.capture_session()`` under
        ``torch.inference_mode()``, and return a :class:`CaptureReport`. Every rank must call it.
        On any error the backend is cleaned up, the runner stays uncaptured and the error
        propagates (a step output the runner cannot slice as ``TypeError``, a padding leak as
        :class:`~graphrunner.errors.PaddingLeakError`, other failures as :class:`CaptureError`
        naming the key). Raises ``CaptureError`` if already captured (:meth:`cleanup` first).
        ``background=True`` returns ``None`` at once and captures on a thread while calls are
        served (:mod:`graphrunner.background`; :meth:`wait_captured`, :attr:`captured_keys`). ``share``
        (background only, in ``(0, 1]``): the capture's share of the time while calls come; after a key
        that took ``d`` s it rests ``d * (1 - share) / share`` s unless no call came for 50 ms
        (:class:`graphrunner.pacing.Pace`; 1, the default: keys back to back, a waiting call first).
        ``ValueError`` for a share outside ``(0, 1]`` or one below 1 with a blocking capture."""
        if not background and check_share(share) != 1.0:
            raise ValueError(f"GraphRunner.capture(share={share!r}) paces a background capture: pass background=True")
        if self.captured:
            raise CaptureError("GraphRunner.capture() was already called; call runner.cleanup() before capturing again")
        if background:
            capture_in_background(self.capturer, self.agree_bucket, share)
            bg = self.server.background
            if bg is not None:  # garbage collection and interpreter exit end the thread before the runner is gone
                weakref.finalize(self, bg.end, "GraphRunner garbage collected or the interpreter exiting")
            return None
        owner = self.server.owner
        owner.enter("capture()")
        try:
            return self.capturer.capture(self.agree_bucket)
        finally:
            owner.leave()

    def wait_captured(self, timeout: float | None = None) -> CaptureReport | None:
        """After ``capture(background=True)``: wait up to ``timeout`` s (None: until done) for every
        key; the report, or ``None`` when it timed out or failed (the next call raises the error).
        On several ranks every rank must call it: it captures the remaining keys now, and they
        replay from the next call (whose agreement tells every rank that every rank has them)."""
        return wait_captured(self.capturer, timeout)

    def hold(self) -> AbstractContextManager[None]:
        """``with runner.hold():`` keeps a background capture from starting a key while the body
        runs (a no-op otherwise): wrap code outside the runner's calls that writes state the step
        reads (a prefill writing the KV cache, a cache reset), since a key's capture puts back what it
        wrote when it ends (:mod:`graphrunner.background`)."""
        return hold_background(self.server)

    @property
    def capture_error(self) -> BaseException | None:
        """The error that stopped a background capture (``None`` while it runs, after it succeeded,
        or without one); the next call raises it as well."""
        server = self.server
        bg = server.background or server.last_background
        return None if bg is None else bg.error

    @property
    def captured_keys(self) -> list[Any]:
        """The keys that replay (every key after a blocking capture; during a background one, those
        captured on every rank so far)."""
        server = self.server
        return [server.space.external(k) for k in server.space.keys if server.routes.replayable.get(k)]

    def cleanup(self) -> None:
        """Release every graph and the output buffer (``backend.cleanup()``); the runner can
        :meth:`capture` again. Static input buffers are kept. Raises :class:`GraphRunnerError` at once,
        releasing nothing, while a call is in progress on another thread (its outputs are views of
        the buffer this would release): clean up between calls."""
        owner = self.server.owner
        owner.enter("cleanup()")
        try:
            self.capturer.cleanup()
        finally:
            owner.leave()

    def compare(self, **inputs: torch.Tensor) -> CompareReport:
        """Run the graph and an eager reference on ``inputs`` (staged exactly as a call) and
        localise any difference: a :class:`graphrunner.checks.compare.CompareReport`. State the
        step writes is put back. See :func:`graphrunner.checks.compare.compare_runner`."""

        return compare_runner(self.server, inputs)

    # ----------------------------------------------------------------- call
    def __call__(self, *args: Any, **inputs: torch.Tensor) -> Any:
        """``runner(**inputs)``: same as :meth:`run` with the runner's ``copy_outputs``. Inputs go by
        keyword only (``TypeError`` naming them for a positional call)."""
        if args:
            raise positional_error(args, list(self.inputs))
        server = self.server
        if server.background is None:  # run()'s plain case, one frame less per call
            return server.run(inputs, None, None)
        return self.run(inputs)

    def run(self, inputs: Mapping[str, torch.Tensor], copy_outputs: bool | None = None, step: int | None = None) -> Any:
        """Serve one batch: validate, agree, copy + pad, replay (or fall back), slice.

        ``inputs``: every declared name, a tensor of the declared dtype and trailing shape
        (any device). Returns what ``step`` returns, sliced to the call's sizes: views the next
        call overwrites unless ``copy_outputs`` (default: the runner's). A size of 0 (an idle rank)
        is valid: the step runs only if a peer has rows there or some output would not be empty
        (``docs/multirank.md``, "Idle ranks"); the outputs have 0 rows. During a background capture
        on several ranks, a call with every input empty on every rank is an idle server's tick: its
        agreement grants the next key, and it does not count as busy for ``share``'s rest. Invalid inputs raise
        ``ValueError``/``TypeError`` before anything is written; the runner stays usable. Raises
        :class:`CaptureError` before :meth:`capture`, :class:`GraphRunnerError` during another call.
        ``step``: the engine's own step number (an int >= 0), on several ranks agreed with the call:
        ranks at different steps (one skipped or repeated a step) raise
        :class:`~graphrunner.keys.AgreementError` on every rank at that call (every rank passes it or none)."""
        if step is not None:
            step = check_step(step)
        server = self.server
        bg = server.background
        if bg is not None:  # a background capture: wait for the key it is capturing, hold it back meanwhile
            bg.before_call()
            # a call without rows (every input empty: an idle rank's tick) serves nothing a capture would slow
            with bg.call(busy=any(t.numel() for t in inputs.values() if isinstance(t, torch.Tensor))):
                return server.run(inputs, copy_outputs, step)
        return server.run(inputs, copy_outputs, step)


def _key_text(space: KeySpace, key: tuple[int, ...]) -> str:
    """How messages name internal ``key`` of ``space``."""
    return f"bucket {key[0]}" if space.one_batch_dim else f"key {key} ({space.describe(key)})"
