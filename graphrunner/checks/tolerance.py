"""The last-bit tolerance of the checks that compare a graph's results with eager's.

:func:`difference` compares two results, exactly or within :func:`admitted`: per element the
last-bit noise of kernels chosen for another shape (:class:`Noise` says where the tensors come
from), never a share of the output's largest value. Used by the padding check
(:mod:`graphrunner.checks.leak_check`), by ``verify_every=``
(:mod:`graphrunner.checks.verify`) and by ``gr.hf``'s self-test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Noise", "STORAGE_ULPS", "ACCUMULATION_ULPS", "UNKNOWN_WORK", "admitted", "difference"]


@dataclass(frozen=True)
class Noise:
    """What a tolerant :func:`difference` admits: the last-bit noise of kernels chosen for another
    shape, nothing more.

    ``lead``: how many leading (row) dims the compared tensors have (the column scale of an
    element is the root mean square of its column over them); ``reduction``: the longest
    reduction (the ``K`` of a matmul) of the step, and ``matmuls``: how many matmul-like ops it
    runs, as the padding check measures them in its first run (0: unknown, then a large model
    is assumed: ``reduction * matmuls = 2**20``). See :func:`admitted`.
    """

    lead: int = 1
    reduction: int = 0
    matmuls: int = 0


#: Ulps of the output's own dtype a tolerant comparison admits per element (the rounding of
#: the last op, and a flip it may cause upstream).
STORAGE_ULPS = 2.0
#: Accumulator ulps admitted per ``sqrt(reduction * matmuls)``: a reduction summed in another
#: order moves its result by about ``eps * sqrt(K)`` of its terms' scale, and every matmul of the
#: step adds its own.
ACCUMULATION_ULPS = 16.0
#: ``reduction * matmuls`` assumed when a comparison does not know them.
UNKNOWN_WORK = 2**20


def admitted(b: torch.Tensor, noise: Noise | None = None) -> torch.Tensor:
    """Per element of ``b`` (the reference), the absolute difference a tolerant comparison admits,
    as float64::

        (|b_i| + s_i) * (STORAGE_ULPS * eps + ACCUMULATION_ULPS * eps_acc * sqrt(reduction * matmuls))

    ``eps``: the dtype's machine epsilon; ``eps_acc``: the accumulator's (float32 for float16
    and bfloat16, whose kernels accumulate in float32; the dtype's own otherwise); ``s_i``: the
    root mean square of the element's column over the ``lead`` dims (of the whole tensor when
    it has no other dims), at least 1/8 of the whole tensor's, a floor for elements near zero
    that cancellation made small. So a difference of a few percent in a small channel is a leak
    in bfloat16 (about 2 ulps admitted) as in float32, while the float32 noise of a deep step
    (a few hundred ulps where the kernel of a 256-long reduction changed) is not."""
    noise = noise or Noise()
    dt = b.real.dtype if b.dtype.is_complex else b.dtype
    eps = torch.finfo(dt).eps
    eps_acc = torch.finfo(torch.float32).eps if torch.finfo(dt).bits < 32 else eps
    work = noise.reduction * noise.matmuls if noise.reduction > 0 and noise.matmuls > 0 else UNKNOWN_WORK
    factor = STORAGE_ULPS * eps + ACCUMULATION_ULPS * eps_acc * math.sqrt(work)
    mag = torch.nan_to_num(b.detach().abs().to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
    if mag.dim() == 0 or mag.numel() == 0:
        return mag * (2 * factor)
    whole = mag.pow(2).mean().sqrt()
    lead = max(0, min(int(noise.lead), mag.dim()))
    col = mag.pow(2).mean(dim=tuple(range(lead)), keepdim=True).sqrt() if 0 < lead < mag.dim() else whole
    return (mag + torch.maximum(col, whole / 8)) * factor


def difference(a: torch.Tensor, b: torch.Tensor, tolerant: bool | Noise = False) -> float | None:
    """``None`` if equal (NaN equals NaN), else the max abs difference (inf for a shape or dtype change).

    ``tolerant`` (``True`` or a :class:`Noise` saying where the tensors come from): floating-point
    values count as equal where every element is within :func:`admitted` of ``b``'s: the last-bit
    noise of kernels a library picks by row count (an MoE expert's share of the rows moves when
    padding rows become real), scaled per element by its magnitude and the dtype's epsilon, never
    a share of the output's largest value."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    if a.dtype.is_floating_point or a.dtype.is_complex:
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        if bool(same.all()):
            return None
        wide = torch.complex128 if a.dtype.is_complex else torch.float64
        d = torch.nan_to_num((a.to(wide) - b.to(wide)).abs(), nan=math.inf)
        d = torch.where(same, torch.zeros_like(d), d)
        if tolerant:
            ok = d <= admitted(b, tolerant if isinstance(tolerant, Noise) else None)
            if bool(ok.all()):
                return None
        return float(d.max())
    if torch.equal(a, b):
        return None
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())
