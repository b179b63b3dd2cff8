"""The eager prefill and the capturable one-token decode step of a transformers causal LM.

:func:`make_decode_step` and :func:`decode_inputs` are the plain step
(``input_ids``, ``position_ids``; the model builds its masks; equal-length
prompts) for tools that drive the cache themselves. :func:`make_masked_step`
and :func:`masked_inputs` are the step :class:`~graphrunner.hf.DecodeRunner`
captures: it also takes ``cache_position`` and ``first_slot`` and, under an
explicit :class:`~graphrunner.hf.masks.MaskPlan`, builds every layer type's
attention mask inside the step (sliding windows, left-padded prompts).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from graphrunner.runner import BatchInput


def forward_names(model) -> dict[str, Any]:
    """The names ``model.forward`` takes: ``{"cache": "past_key_values" or "cache", "cache_position": bool}``."""
    params = inspect.signature(model.forward).parameters
    return {
        "cache": "cache" if "cache" in params else "past_key_values",
        "cache_position": "cache_position" in params,
    }


def prompt_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row position ids of left-padded prompts, as ``model.generate`` gives them: ``cumsum(mask) - 1``, pad slots 1."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def prefill(model, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run the prompt ``input_ids`` ``[B, P]`` eagerly through ``model``, writing ``cache``; return logits ``[B, P, V]``.

    Without ``attention_mask`` every row is at positions ``0..P-1``
    (equal-length prompts). With a ``[B, P]`` 0/1 ``attention_mask`` (left
    padding), positions follow :func:`prompt_positions` and the model masks
    the pad slots, as ``model.generate`` does.
    """
    names = forward_names(model)
    b, p = input_ids.shape
    slots = torch.arange(p, device=input_ids.device)
    kwargs: dict[str, Any] = {names["cache"]: cache, "use_cache": True}
    if attention_mask is None:
        kwargs["position_ids"] = slots.unsqueeze(0).expand(b, p)
    else:
        kwargs["position_ids"] = prompt_positions(attention_mask)
        kwargs["attention_mask"] = attention_mask
    if names["cache_position"]:
        kwargs["cache_position"] = slots
    return model(input_ids=input_ids, **kwargs).logits


def _picker(cache) -> Callable[[int], Any]:
    return cache if callable(cache) else (lambda _batch: cache)


def make_decode_step(model, cache) -> Callable[..., torch.Tensor]:
    """Return ``step(input_ids, position_ids) -> logits``: one decode token per row through ``cache``.

    ``input_ids`` and ``position_ids`` are ``[B, 1]`` long tensors (row 0 gives
    the write position; all real rows share it); the result is the
    ``[B, 1, vocab]`` logits tensor (only tensors may leave a captured
    forward, so the ``ModelOutput`` and the cache object stay inside).
    ``cache`` is one cache, or a callable ``cache(batch) -> cache`` choosing
    one per batch size. The step writes the cache in place and holds no
    Python state that changes between calls, so it can be captured.
    """
    names = forward_names(model)
    pick = _picker(cache)

    def step(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        kwargs = {names["cache"]: pick(input_ids.shape[0]), "position_ids": position_ids, "use_cache": True}
        if names["cache_position"]:
            kwargs["cache_position"] = position_ids[0]  # a view: rows share one position
        return model(input_ids=input_ids, **kwargs).logits

    return step


def make_masked_step(model, cache, plan, length: int) -> Callable[..., torch.Tensor]:
    """Return ``step(input_ids, position_ids, cache_position, first_slot) -> logits`` (all ``[B, 1]`` long).

    ``cache_position`` is the slot every real row writes (row 0's is passed
    to the model); ``first_slot`` the first real slot of each row (left
    padding). Under an explicit ``plan`` (:class:`~graphrunner.hf.masks.MaskPlan`)
    the step passes ``plan.build(...)`` as ``attention_mask``; otherwise the
    model builds its own masks and ``first_slot`` is unused. ``length`` is
    the cache's slot count. ``plan`` may also be a zero-argument callable
    returning the plan (read at every call, so a runner can settle its plan
    before capture). ``cache`` as in :func:`make_decode_step`.
    """
    names = forward_names(model)
    pick = _picker(cache)
    dtype = model.dtype
    get_plan = plan if callable(plan) else (lambda: plan)

    def step(
        input_ids: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor, first_slot: torch.Tensor
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {
            names["cache"]: pick(input_ids.shape[0]),
            "position_ids": position_ids,
            "use_cache": True,
        }
        if names["cache_position"]:
            kwargs["cache_position"] = cache_position[0]
        current = get_plan()
        if current.explicit:
            kwargs["attention_mask"] = current.build(cache_position, first_slot, length, dtype)
        return model(input_ids=input_ids, **kwargs).logits

    return step


def _long_input(upper: int | None) -> BatchInput:
    return BatchInput(trailing=(1,), dtype=torch.long, pad=0, bounds=None if upper is None else (0, int(upper) - 1))


def decode_inputs(vocab_size: int | None = None, max_cache_len: int | None = None) -> dict[str, Any]:
    """Return the GraphRunner input spec of :func:`make_decode_step`: ``input_ids`` and ``position_ids``, ``[B, 1]`` long.

    ``vocab_size`` and ``max_cache_len``, when given, become the inputs' ``bounds`` (the padding
    check at capture draws real token ids and positions from them)."""
    return {"input_ids": _long_input(vocab_size), "position_ids": _long_input(max_cache_len)}


def masked_inputs(vocab_size: int | None, max_cache_len: int) -> dict[str, Any]:
    """The GraphRunner input spec of :func:`make_masked_step`: four ``[B, 1]`` long inputs, padded with 0.

    A padding row decodes token 0 at position 0 into slot 0 and attends slot 0 only: finite."""
    return {
        **decode_inputs(vocab_size, max_cache_len),
        "cache_position": _long_input(max_cache_len),
        "first_slot": _long_input(max_cache_len),
    }
