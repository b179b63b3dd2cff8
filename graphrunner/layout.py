"""The output layout: which leading dims of each output the runner slices, and the slicing.

:class:`OutputLayout` checks at capture that the step returns a pytree of
tensors whose declared leading dims have the key's sizes (and the same
trailing shapes for every key), and serves each call its outputs sliced to
the call's sizes: cached views of the backend's one output buffer after a
replay (the ``sizes`` view is the same tensor whichever key replayed), or a
slice of an eager fallback's fresh outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from graphrunner.backends.outputs import flatten, unflatten
from graphrunner.errors import CaptureError, PaddingLeakError
from graphrunner.keys import MEMO_LIMIT, count_leaves, slice_leaves

__all__ = ["OutputLayout", "StepOutputError", "FreshOutputs", "clone_outputs", "user_error"]

Sizes = tuple[int, ...]


class StepOutputError(TypeError):
    """The step returned something the runner cannot slice (raised during capture)."""


class OutputLayout:
    """The leading dims of every output leaf, from ``outputs=`` (keywords; resolved by
    :func:`graphrunner.keys.resolve_output_dims`): ``out_dims = (default, {dict key: dims})``
    as indices into ``dims``; ``one_batch_dim``: built with ``buckets=[...]`` (one dim, the batch);
    ``key_text(key)`` names a key."""

    def __init__(
        self,
        *,
        out_dims: tuple[tuple[int, ...], dict[Hashable, tuple[int, ...]]],
        dims: tuple[str, ...],
        one_batch_dim: bool,
        key_text: Callable[[Sizes], str],
    ) -> None:
        self.default, self.per_key = out_dims
        self.dims, self.one_batch_dim, self.key_text = dims, one_batch_dim, key_text
        #: How many leading dims of an output may be smaller than the shared buffer's.
        self.lead = max([len(self.default)] + [len(v) for v in self.per_key.values()])
        #: True while the runner captures: the forwards of :meth:`forward` check their outputs.
        self.capturing = False
        #: ``explain(forward) -> str | None``: names the op and line behind an output shape the runner
        #: cannot slice (set by the capturer: :func:`graphrunner.checks.lint.first_unsafe_op`).
        self.explain: Callable[[Callable[[], Any]], str | None] | None = None
        self.reset()

    def forward(
        self, step: Callable[..., Any], key: Sizes, views: dict[str, torch.Tensor], name: str
    ) -> Callable[[], Any]:
        """``forward()``: ``step(**views)`` for ``key`` (the backend's forward_fn), its output
        checked by :meth:`check` while :attr:`capturing` (an eager backend's replays are not)."""

        def forward() -> Any:
            out = step(**views)
            if self.capturing:
                try:
                    self.check(out, key)
                except StepOutputError as exc:
                    why = self.explain(forward) if self.explain is not None else None
                    if why is None:
                        raise
                    raise StepOutputError(
                        f"{exc} The likely cause: the step ran {why}, which a device graph cannot hold. Move that code into a function decorated with "
                        "@no_graph (it runs eagerly between graph segments), or rewrite it with static "
                        "shapes (torch.where(mask, x, 0) instead of x[mask])"
                    ) from None
            return out

        forward.__qualname__ = name
        return forward

    def all_empty(self, result: Any, sizes: Sizes) -> bool:
        """True when every leaf of the outputs ``result`` (a replay's static outputs) is empty once
        sliced to ``sizes``: each spans a dim whose size is 0. Such a call (an idle rank) needs
        no step at all; a 0-dim leaf, or one only on dims of nonzero size, needs the step run."""
        if type(result) is FreshOutputs:
            return False
        spec, leaves = flatten(result)
        dims = self.leaf_dims(spec, len(leaves))
        return all(t.dim() > 0 and any(sizes[d] == 0 for d in ds) for t, ds in zip(leaves, dims))

    def reset(self) -> None:
        """Forget what the captures taught (trailing shapes, cached views)."""
        self._trailing: list[tuple[int, ...]] | None = None
        #: ``{sizes: the output views}``: the one tensor, or the list of tensor leaves when :attr:`_spec` is set.
        self._views: dict[Sizes, torch.Tensor | list[torch.Tensor]] = {}
        self._spec: tuple | None = None

    def fingerprint(self) -> dict[str, Any]:
        """The layout as the cross-rank configuration check compares it."""
        return {
            "default": [self.dims[d] for d in self.default],
            "per_key": {str(k): [self.dims[d] for d in v] for k, v in self.per_key.items()},
        }

    def leaf_dims(self, spec: tuple, n_leaves: int) -> list[tuple[int, ...]]:
        """The runner-dim indices of the leading dims of every tensor leaf of an output with ``spec``."""
        if self.per_key and spec[0] == "dict":
            idx: list[tuple[int, ...]] = []
            for k, child in zip(spec[2], spec[3]):
                idx.extend([self.per_key.get(k, self.default)] * count_leaves(child))
            return idx
        return [self.default] * n_leaves

    def check(self, out: Any, key: Sizes) -> None:
        """Raise :class:`StepOutputError` unless ``out`` (the step's output for ``key``) is a
        pytree of tensors with the key's sizes on their declared leading dims, and the trailing
        shapes of the first key captured."""
        try:
            spec, leaves = flatten(out, "step output")
        except TypeError as exc:
            raise StepOutputError(
                f"step returned something that is not a pytree of tensors for {self.key_text(key)}: {exc}"
            ) from None
        trailing: list[tuple[int, ...]] = []
        for i, (t, dims) in enumerate(zip(leaves, self.leaf_dims(spec, len(leaves)))):
            want = tuple(key[d] for d in dims)
            if t.dim() == 0:
                trailing.append(())
                continue
            if tuple(t.shape[: len(want)]) != want:
                if self.one_batch_dim:
                    raise StepOutputError(
                        f"step output tensor {i} has shape {list(t.shape)} for bucket {key[0]}: every output tensor "
                        f"must be batch-major (dim 0 == the {key[0]} input rows) or 0-dim, so the runner can slice "
                        "it to the real batch. Return per-row results, or compute batch-independent values outside "
                        "step."
                    )
                names = tuple(self.dims[d] for d in dims)
                raise StepOutputError(
                    f"step output tensor {i} has shape {list(t.shape)} for {self.key_text(key)}: its leading dims "
                    f"{names} (from outputs=) must be {list(want)}, so the runner can slice it to the real sizes. "
                    "Declare each output's leading dims with outputs= (a dims tuple, or {key: dims} for a dict)."
                )
            trailing.append(tuple(t.shape[len(want) :]))
        if self._trailing is None:
            self._trailing = trailing
            return
        for i, (a, b) in enumerate(zip(self._trailing, trailing)):
            if a != b:
                raise StepOutputError(
                    f"step output tensor {i} has trailing shape {list(b)} after its leading dims for "
                    f"{self.key_text(key)}, but {list(a)} for the first key captured: only the dims declared "
                    "in outputs= may change between keys. Declare that dim in outputs="
                )

    def replayed(self, result: Any, sizes: Sizes) -> Any:
        """The outputs of a call of ``sizes`` from a replay's ``result`` (views of the shared
        output buffer, cached per ``sizes``, at most ``keys.MEMO_LIMIT`` of them; every key's
        outputs are leading-corner views of one buffer, so the ``sizes`` view is the same whichever
        key replayed). ``result`` may be a
        :class:`FreshOutputs` box holding the output of a backend that is not a
        :class:`~graphrunner.backends.base.GraphBackend` (fresh outputs each replay: sliced, not cached)."""
        if type(result) is FreshOutputs:
            return self.slice(result.value, sizes)
        out = self._views.get(sizes)
        if out is None:
            spec, leaves = flatten(result)
            sliced = slice_leaves(leaves, self.leaf_dims(spec, len(leaves)), sizes)
            if spec == ("T",):
                self._spec, out = None, sliced[0]
            else:
                self._spec, out = spec, sliced
            if len(self._views) >= MEMO_LIMIT:  # varlen sizes rarely repeat: start over, never grow unbounded
                self._views.clear()
            self._views[sizes] = out
        # one branch on the hot path: the cached value is the tensor when _spec is None, else the list of
        # leaves (the two are set on the same miss, and the spec is the step's whatever key replayed)
        return out if self._spec is None else unflatten(self._spec, out)  # type: ignore[arg-type]

    def slice(self, out: Any, sizes: Sizes) -> Any:
        """``out`` with every tensor leaf sliced to ``sizes`` on its declared leading dims."""
        spec, leaves = flatten(out)
        sliced = slice_leaves(leaves, self.leaf_dims(spec, len(leaves)), sizes)
        return sliced[0] if spec == ("T",) else unflatten(spec, sliced)


class FreshOutputs:
    """A box for the latest output of a backend whose replays return fresh tensors."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Any = None


def clone_outputs(out: Any) -> Any:
    """A copy of ``out`` with every tensor leaf cloned (``copy_outputs=True``)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if out is None:
        return None
    spec, leaves = flatten(out)
    return unflatten(spec, [t.clone() for t in leaves])


def user_error(exc: BaseException) -> BaseException:
    """The error ``GraphRunner.capture()`` raises for ``exc``: a step output the runner cannot
    slice as ``TypeError`` and a padding leak as :class:`PaddingLeakError` (unwrapped from the
    backend's ``CaptureError``), anything else unchanged."""
    cause = exc.__cause__ if isinstance(exc, CaptureError) else None
    if isinstance(cause, StepOutputError):
        return TypeError(str(cause))
    if isinstance(cause, PaddingLeakError):
        return PaddingLeakError(str(cause))
    return exc
