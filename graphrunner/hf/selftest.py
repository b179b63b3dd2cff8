"""The capture-time self-test of :class:`~graphrunner.hf.DecodeRunner`: replayed decode steps against the model's own.

The capture checks (drift, padding, unsafe ops) look at one step. The
self-test looks at what a user gets: for every bucket (and one padded batch)
it prefills a random prompt, replays a few decode steps through the captured
graphs, and compares each step's logits with the model's own eager decode
(transformers' ``StaticCache`` layers and mask creation, exactly as
``model.generate(..., cache_implementation="static")`` runs it), feeding
both the same tokens. Under an explicit mask plan one row is left-padded, so
the masks the step builds are compared with the ones transformers builds.
Logits must agree within the float tolerance of
:func:`graphrunner.checks.tolerance.difference` (kernels chosen for another row
count or cache length move the last bits); anything more raises
:class:`~graphrunner.errors.CaptureError`. The runner's cache is emptied
afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphrunner.checks.tolerance import difference
from graphrunner.errors import CaptureError
from graphrunner.hf.cache import make_static_cache
from graphrunner.hf.steps import forward_names, prefill, prompt_positions
from graphrunner.progress import CaptureProgress


@dataclass(frozen=True)
class SelfTestResult:
    """What the self-test compared: the batch ``sizes``, ``steps`` replayed per size, and the worst
    absolute logit difference seen (``0.0``: every step bit-equal to the model's own eager decode)."""

    sizes: tuple[int, ...]
    steps: int
    worst: float

    @property
    def exact(self) -> bool:
        """True when every compared logit was bit-equal."""
        return self.worst == 0.0

    def summary(self) -> str:
        """One line: what was compared and how close, e.g. ``batches 1, 2, 4, 3 x 3 decode steps, bit-equal``."""
        close = "bit-equal" if self.exact else f"max abs logit difference {self.worst:.2g}, within tolerance"
        return f"batches {', '.join(map(str, self.sizes))} x {self.steps} decode steps vs eager, {close}"


def self_test_sizes(buckets: list[int]) -> tuple[int, ...]:
    """Every bucket, plus the largest bucket minus one (a padded replay) when that is not a bucket itself."""
    sizes = list(buckets)
    if buckets[-1] - 1 >= 1 and buckets[-1] - 1 not in buckets:
        sizes.append(buckets[-1] - 1)
    return tuple(sizes)


def _reference_step(model, names, cache, tokens, mask2d, positions, slot):
    kwargs: Any = {names["cache"]: cache, "position_ids": positions, "use_cache": True}
    if mask2d is not None:
        kwargs["attention_mask"] = mask2d
    if names["cache_position"]:
        kwargs["cache_position"] = torch.tensor([slot], device=tokens.device)
    return model(input_ids=tokens, **kwargs).logits


def run_self_test(dr: Any, steps: int = 3, seed: int = 0, progress: bool = False) -> SelfTestResult:
    """Compare ``dr``'s replayed decode steps with the model's own eager decode; raise ``CaptureError`` on a difference.

    ``dr`` is a captured :class:`~graphrunner.hf.DecodeRunner`. ``steps``
    decode steps per size (fewer when ``max_cache_len`` is short); prompts
    and pad rows come from ``seed``. ``progress``: a progress bar on stderr
    (one batch size at a time). Runs under ``torch.inference_mode``.
    """
    prompt = max(1, min(4, dr.max_cache_len - 1))
    replays = max(1, min(steps, dr.max_cache_len - prompt))
    g = torch.Generator().manual_seed(seed)
    sizes = self_test_sizes(dr.buckets)
    bar = CaptureProgress(len(sizes), enabled=progress, desc="gr.hf self-test", label="batch")
    ok = False
    try:
        with torch.inference_mode():
            worst = _compare(dr, sizes, prompt, replays, g, bar)
        ok = True
    finally:
        bar.close(ok)
    dr._reset_cache()
    return SelfTestResult(sizes=sizes, steps=replays, worst=worst)


def _compare(dr: Any, sizes: tuple[int, ...], prompt: int, replays: int, g: torch.Generator, bar: Any) -> float:
    """The self-test's comparisons (prompts of ``prompt`` tokens drawn from ``g``, ``replays`` steps per size);
    returns the worst exact difference."""
    model, dev, names = dr.model, dr.model.device, forward_names(dr.model)
    worst = 0.0
    for i_size, n in enumerate(sizes):
        bar.start(i_size, n)
        ids = torch.randint(0, dr.vocab_size, (n, prompt), generator=g).to(dev)
        mask = torch.ones((n, prompt), dtype=torch.long, device=dev)
        if dr.plan.explicit and prompt >= 2 and n >= 2:
            mask[0, 0] = 0  # one left-padded row: the step's masks against transformers' own
        ragged = bool((mask == 0).any())
        ref_cache = make_static_cache(model, n, prompt + replays)
        want = prefill(model, ref_cache, ids, mask if ragged else None)
        dr._reset_cache()
        dr._prefill(ids, mask if ragged else None)
        positions = prompt_positions(mask)[:, -1:]
        first = (mask == 0).sum(-1, keepdim=True)
        for i in range(replays):
            tokens = want[:, -1].argmax(-1, keepdim=True)
            positions = positions + 1
            slot = prompt + i
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=dev)], dim=1)
            want = _reference_step(model, names, ref_cache, tokens, mask if dr.plan.explicit else None, positions, slot)
            got = dr.runner(
                input_ids=tokens,
                position_ids=positions,
                cache_position=torch.full((n, 1), slot, dtype=torch.long, device=dev),
                first_slot=first,
            )
            diff = difference(got.float(), want.float(), tolerant=True)
            exact = difference(got.float(), want.float())
            worst = max(worst, exact or 0.0)
            if diff is not None:
                dr._reset_cache()
                raise CaptureError(
                    f"gr.hf.DecodeRunner: the replayed decode step of architecture {dr.model_type!r} differs "
                    f"from the model's own eager decode at batch {n} (bucket {dr.runner.bucket_for(n)}), "
                    f"decode step {i + 1}: max abs logit difference {diff:.3g} ({_plan_text(dr.plan)}); a "
                    f"graph would give wrong tokens. Decode this model with model.generate()"
                )
    return worst


def _plan_text(plan: Any) -> str:
    if plan.explicit:
        return "masks built by the step: " + ", ".join(f"{k or 'all layers'}={v}" for k, v in plan.layers.items())
    return f"masks built by the model ({plan.reason})"


__all__ = ["SelfTestResult", "run_self_test", "self_test_sizes"]
