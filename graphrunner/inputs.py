"""Declared inputs of a GraphRunner: :class:`BatchInput` and the slow-path
diagnosis of call inputs that failed the runner's fast check."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphrunner.keys import check_dims

__all__ = [
    "BatchInput",
    "check_bounds_spec",
    "alias_error",
    "diagnose",
    "check_config",
    "check_step",
    "positional_error",
]

_FALLBACKS = ("eager", "error")

#: A pad value (``BatchInput.pad``): a Python number.
Pad = bool | int | float
#: ``BatchInput.bounds``: ``(lo, hi)``, inclusive, either ``None`` (unbounded).
Bounds = tuple[float | None, float | None]


@dataclass(frozen=True)
class BatchInput:
    """Declares one input of the step, padded on its leading (named) dims.

    A tensor passed for this input has shape ``(*sizes, *trailing)`` and
    exactly ``dtype`` (no implicit casts), where ``sizes`` has one entry per
    name in ``dims``: ``dims=("reqs", "draft")`` is a ``[reqs, draft, *trailing]``
    tensor, ``dims=("tokens",)`` a flattened ragged token axis. ``dims=None``
    (the default) is the runner's only dim (with ``buckets=[...]`` that is
    the batch, dim 0, as before dims existed). The runner keeps one static
    buffer of shape ``(*largest key, *trailing)``; cells beyond the real sizes
    (padding) are set to ``pad`` before a replay, so pick a value the step
    handles harmlessly (token id 0, position 0, zeros).

    ``bounds=(lo, hi)`` (inclusive; either may be ``None``): the valid
    values, e.g. ``(0, vocab - 1)`` for token ids or ``(0, num_slots - 1)``
    for cache slots: the range of the *real* values. ``pad`` may lie inside
    (a real value too) or outside (a scratch value no real row uses, such as
    a dedicated padding slot of a KV cache; the step must accept it). In debug mode
    (``GraphRunner(debug=True)`` or ``GRAPHRUNNER_DEBUG=1``) every call
    checks every real cell before anything is replayed and raises a
    ``ValueError`` naming the input, the row and the value; otherwise
    bounds are not checked (no per-call cost). The padding check at capture
    draws the input's real cells from inside the bounds.

    ``state=True``: the step may write into this input (scratch it updates in
    place). A graph writes the runner's static buffer, never the caller's
    tensor, so the runner re-pads the input's padding cells after every call
    and its eager fallback writes a copy, never the caller's tensor. Without
    it, a step that writes into an input is refused at capture.
    """

    trailing: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    pad: Pad = 0
    dims: tuple[str, ...] | None = None
    bounds: Bounds | None = None
    state: bool = False

    def __post_init__(self) -> None:
        trailing = self.trailing
        if isinstance(trailing, int) and not isinstance(trailing, bool):
            trailing = (trailing,)
        try:
            trailing = tuple(trailing)
        except TypeError:
            raise TypeError(f"BatchInput.trailing must be a tuple of ints, got {self.trailing!r}") from None
        for d in trailing:
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise ValueError(f"BatchInput.trailing must hold ints >= 0, got {self.trailing!r}")
        object.__setattr__(self, "trailing", trailing)
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"BatchInput.dtype must be a torch.dtype such as torch.long, got {self.dtype!r}")
        if isinstance(self.pad, torch.Tensor) or not isinstance(self.pad, (bool, int, float)):
            raise TypeError(f"BatchInput.pad must be a Python number, got {type(self.pad).__name__} ({self.pad!r})")
        if (
            not self.dtype.is_floating_point
            and not self.dtype.is_complex
            and isinstance(self.pad, float)
            and not float(self.pad).is_integer()
        ):
            raise ValueError(f"BatchInput.pad {self.pad!r} is not representable in {self.dtype}")
        if self.dims is not None:
            object.__setattr__(self, "dims", check_dims(self.dims, "BatchInput.dims"))
        object.__setattr__(self, "bounds", check_bounds_spec(self.bounds, self.pad, self.dtype))
        if not isinstance(self.state, bool):
            raise TypeError(f"BatchInput.state must be True or False, got {self.state!r}")


def check_bounds_spec(bounds: Any, pad: Pad, dtype: torch.dtype) -> Bounds | None:
    """Validate ``BatchInput(bounds=(lo, hi))``: two numbers or ``None`` (unbounded) with ``lo <= hi``.

    ``bounds`` is the range of the *real* values. ``pad`` may lie inside it
    (a real value too, e.g. token id 0: the padding check then puts a real
    cell at the pad, where padding and real rows meet) or outside it (a
    scratch value no real row uses, e.g. a dedicated cache slot: the step
    must still accept it, since padding cells are fed to the graph)."""
    if bounds is None:
        return None
    try:
        lo, hi = bounds
    except (TypeError, ValueError):
        raise TypeError(f"BatchInput.bounds must be a pair (lo, hi) of numbers or None, got {bounds!r}") from None
    for v in (lo, hi):
        if v is not None and (isinstance(v, (bool, torch.Tensor)) or not isinstance(v, (int, float))):
            raise TypeError(f"BatchInput.bounds must be a pair (lo, hi) of numbers or None, got {bounds!r}")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"BatchInput.bounds = {bounds!r}: lo > hi")
    return (lo, hi)


def check_inputs(inputs: Any) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``inputs`` is a non-empty ``{identifier: BatchInput}``."""
    if not isinstance(inputs, Mapping) or not inputs:
        raise ValueError("inputs must be a non-empty dict {name: gr.BatchInput(...)} naming every input of step")
    for name, spec in inputs.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"input name {name!r} must be a Python identifier (it is passed as a keyword)")
        if not isinstance(spec, BatchInput):
            raise TypeError(
                f"inputs[{name!r}] must be a gr.BatchInput(trailing=..., dtype=..., pad=...), got {type(spec).__name__}"
            )


def check_config(step: Any, inputs: Any, fallback: Any, post_warmup_hook: Any, output_arena: Any) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first bad argument of a ``GraphRunner``."""
    if not callable(step):
        raise TypeError(f"step must be callable as step(**inputs), got {type(step).__name__}")
    check_inputs(inputs)
    if fallback not in _FALLBACKS:
        raise ValueError(f"fallback must be one of {_FALLBACKS}, got {fallback!r}")
    if post_warmup_hook is not None and not callable(post_warmup_hook):
        raise TypeError(
            f"post_warmup_hook must be callable as hook(bucket) or None, got {type(post_warmup_hook).__name__}"
        )
    if output_arena is not None and not callable(getattr(output_arena, "carve", None)):
        raise TypeError(f"output_arena must be a gr.OutputArena or None, got {type(output_arena).__name__}")


def positional_error(args: Sequence[Any], names: Sequence[str]) -> TypeError:
    """The error for a call ``runner(x)`` with positional ``args``: the inputs go by keyword."""
    got = ", ".join(
        f"{type(a).__name__} of shape {list(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
        for a in args
    )
    return TypeError(
        f"GraphRunner takes its inputs by keyword, got {len(args)} positional argument(s) ({got}); "
        f"call runner({', '.join(f'{n}=...' for n in names)}) with every declared input {list(names)}"
    )


def alias_error(
    ranges: Sequence[tuple[int, int]], names: Sequence[str], name: str, t: torch.Tensor
) -> Exception | None:
    """The error for input ``name`` whose memory starts inside one of the
    runner's static buffers (``ranges``: ``[start, end)`` addresses, one per ``names``) (other than exactly its own leading region,
    contiguous), else ``None``. Copying from such a tensor would read
    cells that this same call overwrites."""
    ptr = t.data_ptr()
    for (lo, hi), other in zip(ranges, names):
        if lo <= ptr < hi and not (other == name and ptr == lo and t.is_contiguous()):
            return ValueError(
                f"GraphRunner: input {name!r} aliases the runner's static buffer of input {other!r} (a view of "
                f"runner.static_inputs[{other!r}] or of its memory): the call would overwrite what it reads. "
                "Pass a separate tensor (e.g. .clone())"
            )
    return None


def diagnose(
    inputs: Any,
    specs: Mapping[str, BatchInput],
    in_dims: Mapping[str, tuple[int, ...]],
    dims: Sequence[str],
    one_batch_dim: bool,
    alias: Callable[[str, torch.Tensor], Exception | None],
) -> Exception:
    """The error to raise for call ``inputs`` that failed the runner's fast check (slow path).

    ``specs`` are the declared inputs, ``in_dims[name]`` the indices in
    ``dims`` of each input's leading dims, ``one_batch_dim`` true for a runner built
    with ``buckets=[...]`` (messages speak of the batch), ``alias`` the
    runner's aliasing check. Names the input and what was expected.
    """
    name: str | None = None
    try:
        if not isinstance(inputs, Mapping):
            return TypeError(
                f"GraphRunner inputs must be passed as keywords {list(specs)}, got {type(inputs).__name__}"
            )
        missing = [k for k in list(specs) if k not in inputs]
        extra = [k for k in inputs if k not in specs]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing input(s) {missing}")
            if extra:
                parts.append(f"unexpected input(s) {extra}")
            return ValueError(f"GraphRunner: {' and '.join(parts)}; the step takes exactly {list(specs)}")
        seen: dict[int, tuple[int, str]] = {}
        for name, spec in specs.items():
            t = inputs[name]
            didx = in_dims[name]
            if not isinstance(t, torch.Tensor):
                return TypeError(f"GraphRunner: input {name!r} must be a torch.Tensor, got {type(t).__name__}")
            if t.layout != torch.strided:  # sparse, sparse CSR/CSC/BSR, nested (jagged), mkldnn: no plain storage
                kind = "a sparse tensor" if "sparse" in str(t.layout) else "not a dense tensor"
                return ValueError(
                    f"GraphRunner: input {name!r} is {kind} (layout {t.layout}); pass a dense (strided) "
                    f"tensor, e.g. {name}.to_dense()"
                )
            if t.dtype != spec.dtype:
                return ValueError(
                    f"GraphRunner: input {name!r} has dtype {t.dtype}, expected {spec.dtype}; "
                    f"convert it with .to({spec.dtype})"
                )
            if t.dim() != len(spec.trailing) + len(didx) or tuple(t.shape[len(didx) :]) != spec.trailing:
                lead = "batch" if one_batch_dim else ", ".join(dims[d] for d in didx)
                return ValueError(
                    f"GraphRunner: input {name!r} has shape {list(t.shape)}, expected "
                    f"[{lead}, {', '.join(map(str, spec.trailing))}]".replace(", ]", "]")
                    + f" (trailing shape {spec.trailing})"
                )
            if t.is_meta:
                return ValueError(
                    f"GraphRunner: input {name!r} is on the meta device (shape only, no data); "
                    "pass a tensor that holds its values"
                )
            try:
                t.data_ptr()
            except Exception as exc:  # noqa: BLE001 - a tensor without storage (a wrapper subclass, a fake tensor)
                return ValueError(
                    f"GraphRunner: input {name!r} ({type(t).__name__}) has no storage to copy from "
                    f"({type(exc).__name__}: {exc}); pass a dense tensor that holds its values"
                )
            err = alias(name, t)
            if err is not None:
                return err
            for j, d in enumerate(didx):
                v = t.shape[j]
                if d not in seen:
                    seen[d] = (v, name)
                elif seen[d][0] != v:
                    if one_batch_dim:
                        return ValueError(
                            f"GraphRunner: input {name!r} has batch {v} but input {seen[d][1]!r} has "
                            f"batch {seen[d][0]}; all inputs share dim 0"
                        )
                    return ValueError(
                        f"GraphRunner: input {name!r} has {dims[d]}={v} (dim {j}) but input "
                        f"{seen[d][1]!r} has {dims[d]}={seen[d][0]}; inputs sharing a dim name "
                        "must agree on its size"
                    )
        return ValueError("GraphRunner: invalid inputs")  # pragma: no cover - the fast check found a mismatch
    except Exception as exc:  # noqa: BLE001 - the diagnosis itself must never raise: it is the error to report
        what = "the call's inputs" if name is None else f"input {name!r}"
        return ValueError(
            f"GraphRunner: inspecting {what} raised {type(exc).__name__}: {exc}; pass every declared "
            f"input {list(specs)} as a dense torch.Tensor"
        )


def check_step(step: Any) -> int:
    """``runner.run(inputs, step=...)`` as an int in ``[0, 2**62)`` (the engine's step number);
    ``TypeError`` or ``ValueError`` naming it otherwise."""
    try:
        if isinstance(step, bool):
            raise TypeError
        step = operator.index(step)
    except TypeError:
        raise TypeError(
            f"GraphRunner.run(step=...) must be the engine's step number, an int >= 0, got "
            f"{type(step).__name__} ({step!r})"
        ) from None
    if not 0 <= step < 1 << 62:
        raise ValueError(f"GraphRunner.run(step=...) must be an int in [0, 2**62), got {step}")
    return step
