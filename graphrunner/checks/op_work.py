"""Op-work counting: how many matmul-like ops a run makes and their longest reduction.

What :class:`~graphrunner.checks.tolerance.Noise` needs to scale the last-bit tolerance: the
padding check counts its run A with an :class:`OpWork` consumer on the op recorder.
"""

from __future__ import annotations

import math

import torch

from graphrunner.recording.ops import OpConsumer, OpEvent

__all__ = ["MATMUL_ARG", "OpWork", "work_kind"]

#: Matmul-like aten ops: the argument whose last dim is the reduction (``K``).
MATMUL_ARG: dict[str, int] = {
    "aten::mm": 0,
    "aten::addmm": 1,
    "aten::bmm": 0,
    "aten::baddbmm": 1,
    "aten::addbmm": 1,
    "aten::mv": 0,
    "aten::addmv": 1,
    "aten::dot": 0,
    "aten::vdot": 0,
    "aten::matmul": 0,
    "aten::linear": 0,
    "aten::_scaled_mm": 0,
    "aten::_int_mm": 0,
}
#: How an op reads its reduction length: the index of the argument whose last dim it is, ``"sdpa"``
#: (attention: the head dim or the key count), ``"conv"`` (the kernel's cells), or ``None`` (no matmul).
WorkKind = int | str | None
_WORK_KINDS: dict[object, WorkKind] = {}  # op overload -> how to read its reduction length


def work_kind(func: torch._ops.OpOverload) -> WorkKind:
    """How op overload ``func`` reads its reduction length (:data:`WorkKind`)."""
    name = func._schema.name
    if name in MATMUL_ARG:
        return MATMUL_ARG[name]
    if "scaled_dot_product" in name:
        return "sdpa"
    if name in ("aten::convolution", "aten::_convolution"):
        return "conv"
    return None


class OpWork(OpConsumer):
    """Counts a run's matmul-like ops and their longest reduction (``K``), for
    :class:`~graphrunner.checks.tolerance.Noise`."""

    def __init__(self) -> None:
        self.reduction = 0
        self.matmuls = 0

    def before(self, ev: OpEvent) -> None:
        if ev.func in _WORK_KINDS:
            kind = _WORK_KINDS[ev.func]
        else:
            kind = _WORK_KINDS[ev.func] = work_kind(ev.func)
        if kind is None:
            return
        try:
            args = ev.args
            if kind == "sdpa":
                k = max(int(args[0].shape[-1]), int(args[1].shape[-2]))
            elif kind == "conv":
                k = int(math.prod(args[1].shape[1:]))
            else:
                k = int(args[int(kind)].shape[-1])
        except Exception:  # noqa: BLE001 - an op called another way: count it, reduction unknown
            k = 0
        self.matmuls += 1
        self.reduction = max(self.reduction, k)
