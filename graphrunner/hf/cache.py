"""A ``transformers.StaticCache`` as a graph needs it: allocated once, changed only in place, viewed per bucket.

Two kinds of cache layer hold state. Attention layers (``StaticLayer``) hold
``keys``/``values`` ``[B, heads, max_cache_len, dim]`` and a write-counter
tensor; linear-attention layers (Mamba, the hybrids' linear layers) hold a
``conv_states[0]`` ``[B, channels, kernel]`` and a ``recurrent_states[0]``
``[B, channels, state]``, updated in place (``copy_``), plus a Python flag
``has_previous_state`` that picks the mixer's branch (prefill or one-token
update). :func:`zero_cache` empties both kinds in place and clears the flag.

Sliding-window layers (``StaticSlidingWindowLayer``) keep a Python write
counter and roll their window once full, which a graph would freeze;
:func:`widen_sliding_layers` replaces them with full-length ``StaticLayer``
objects (the window is then applied by the mask, see
:mod:`graphrunner.hf.masks`), costing ``max_cache_len`` instead of
``sliding_window`` slots per such layer.

:func:`row_view_cache` gives a padded bucket ``b`` a cache whose per-layer
state tensors are the views ``[:b]`` of the one ``max_batch`` cache, so the
graph for bucket ``b`` reads and writes rows ``[0, b)``.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

_STATE_DICTS = ("conv_states", "recurrent_states")


def make_static_cache(model, batch_size: int, max_cache_len: int):
    """Return a ``transformers.StaticCache`` for ``model`` holding ``batch_size`` rows of ``max_cache_len`` tokens.

    Works across the constructor signatures of ``transformers`` 4.45 to 5.x:
    ``config`` and ``max_cache_len`` are always passed; ``max_batch_size`` (or
    ``batch_size``), ``device`` and ``dtype`` only where the signature names
    them. On versions that allocate lazily, the tensors appear at the first
    write (the eager prefill), never inside a capture.
    """
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kwargs: dict[str, Any] = {"config": model.config, "max_cache_len": max_cache_len}
    if "max_batch_size" in params:
        kwargs["max_batch_size"] = batch_size
    elif "batch_size" in params:
        kwargs["batch_size"] = batch_size
    if "device" in params:
        kwargs["device"] = model.device
    if "dtype" in params:
        kwargs["dtype"] = model.dtype
    return StaticCache(**kwargs)


def cache_tensors(cache) -> dict[str, torch.Tensor]:
    """Return every tensor a ``StaticCache`` holds, by a readable name.

    On ``transformers`` >= 4.56 these are the tensor attributes of each layer
    in ``cache.layers`` (``keys``, ``values`` and, on 5.x, the write counter
    ``cumulative_length``) and, for linear-attention (Mamba) layers, the
    tensors of its ``conv_states``/``recurrent_states`` dicts (named
    ``layers[i].conv_states[0]``); on older versions the ``key_cache`` and
    ``value_cache`` lists. Raises ``ValueError`` if the cache holds none
    (not yet allocated: prefill it first).
    """
    out: dict[str, torch.Tensor] = {}
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for i, layer in enumerate(layers):
            for name, value in sorted(vars(layer).items()):
                if isinstance(value, torch.Tensor):
                    out[f"layers[{i}].{name}"] = value
                elif name in _STATE_DICTS and isinstance(value, dict):
                    for idx, t in sorted(value.items()):
                        if isinstance(t, torch.Tensor):
                            out[f"layers[{i}].{name}[{idx}]"] = t
    else:
        for attr in ("key_cache", "value_cache"):
            for i, value in enumerate(getattr(cache, attr, None) or []):
                if isinstance(value, torch.Tensor):
                    out[f"{attr}[{i}]"] = value
    if not out:
        raise ValueError("the StaticCache holds no tensors yet: prefill it before capturing or comparing")
    return out


def snapshot_cache(cache) -> dict[str, torch.Tensor]:
    """Return clones of every cache tensor (see :func:`cache_tensors`)."""
    return {name: t.clone() for name, t in cache_tensors(cache).items()}


def restore_cache(cache, snapshot: dict[str, torch.Tensor]) -> None:
    """Copy ``snapshot`` back into the cache tensors *in place*.

    In place matters: a captured graph holds the cache tensors themselves;
    replacing them (``layer.keys = saved``) would leave the graph writing
    tensors the model no longer reads. Call under the same grad mode the
    cache was made in (``torch.inference_mode()`` here). Raises
    ``ValueError`` when the snapshot's names differ from the cache's.
    """
    current = cache_tensors(cache)
    if current.keys() != snapshot.keys():
        raise ValueError(f"snapshot names {sorted(snapshot)} do not match the cache's {sorted(current)}")
    for name, t in current.items():
        t.copy_(snapshot[name])


def zero_cache(cache) -> None:
    """Empty the cache in place: an empty cache at the same addresses.

    Zeroes every cache tensor (keys, values, write counters, Mamba's conv and
    recurrent states) and clears the linear-attention layers' Python flag
    ``has_previous_state``, so that the next forward is a prefill from no
    state (as on a fresh cache); the tensors themselves stay allocated.
    """
    zero_tensors(cache)
    for layer in getattr(cache, "layers", None) or []:
        flags = getattr(layer, "has_previous_state", None)
        if isinstance(flags, dict):
            for idx in flags:
                flags[idx] = False


def zero_tensors(cache) -> None:
    """Zero every cache tensor in place; Python flags untouched."""
    for t in cache_tensors(cache).values():
        t.zero_()


def compare_caches(got, want) -> list[str]:
    """Return one line per cache tensor of ``got`` that is not ``torch.equal`` to ``want``'s (empty: equal)."""
    g, w = cache_tensors(got), cache_tensors(want)
    if g.keys() != w.keys():
        return [f"cache tensor names differ: {sorted(g)} vs {sorted(w)}"]
    bad = []
    for name in g:
        if not torch.equal(g[name], w[name]):
            diff = (
                (g[name].double() - w[name].double()).abs().max().item() if g[name].shape == w[name].shape else "shape"
            )
            bad.append(f"{name}: max abs diff {diff}")
    return bad


def row_view_cache(cache, rows: int, batch: int | None = None):
    """A shallow copy of an allocated ``StaticCache`` whose layers see rows ``[0, rows)`` of ``cache``'s tensors.

    Every per-row tensor of a layer (a tensor attribute, or a tensor in a
    ``conv_states``/``recurrent_states`` dict, of at least 2 dims whose first
    is ``batch``: ``keys``, ``values``, an indexer's ``indexer_keys``, Mamba's
    states) becomes the view ``[:rows]`` (same storage); every other attribute
    (write counters, the ``has_previous_state`` flags dict) is the very same
    object, so resetting the full cache resets every view. ``batch`` defaults
    to the first layer's ``keys`` rows.
    """
    if batch is None:
        batch = next((t.shape[0] for t in cache_tensors(cache).values() if t.dim() >= 2), rows)

    def view_of(t: Any) -> Any:
        return t[:rows] if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == batch else t

    view = copy.copy(cache)
    layers = []
    for layer in cache.layers:
        lv = copy.copy(layer)
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                setattr(lv, name, view_of(value))
            elif name in _STATE_DICTS and isinstance(value, dict):
                setattr(lv, name, {idx: view_of(t) for idx, t in value.items()})
        if hasattr(lv, "batch_size"):
            lv.batch_size = rows
        layers.append(lv)
    view.layers = layers
    return view


def widen_sliding_layers(cache, max_cache_len: int) -> int:
    """Replace every ``StaticSlidingWindowLayer`` of ``cache`` with a ``StaticLayer`` of ``max_cache_len`` slots.

    A sliding layer keeps a Python write counter and rolls its window once
    full; a graph would freeze both. The full-length layer writes at a tensor
    counter like every other attention layer, and the window moves to the
    mask. Call before the cache is allocated (its first forward). Returns the
    number of layers replaced; hybrid layers that combine a sliding window
    with a linear-attention state are left as they are.
    """
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    replaced = 0
    for i, layer in enumerate(cache.layers):
        if type(layer) is StaticSlidingWindowLayer:
            cache.layers[i] = StaticLayer(max_cache_len=max_cache_len)
            replaced += 1
    return replaced


def layer_problem(layer: Any, batch: int) -> str | None:
    """Why a graph cannot hold this allocated cache layer's state in place, or None when it can.

    Checked: linear-attention layers that record their past (their conv
    state is reassigned, not updated); state tensors without ``batch`` rows
    (no padded bucket views); sliding-window layers with a Python write
    counter. ``DummyLayer`` (no state) and never-allocated layers
    (``keys is None``, e.g. a cross-attention layer a text decode never uses)
    hold nothing a replay could miss.
    """
    name = type(layer).__name__
    if getattr(layer, "record_past", False):
        return (
            "a linear-attention cache layer records its past (activate_past_recording), so its conv state grows "
            "and is reassigned instead of updated in place; a graph would write a stale tensor. Do not record "
            "the past"
        )
    if hasattr(layer, "cumulative_length_int"):
        return f"cache layer {name} keeps a Python write counter (cumulative_length_int) that a graph would freeze"
    states = [
        t
        for attr in _STATE_DICTS
        for idx, t in (getattr(layer, attr, None) or {}).items()
        if t is not None or getattr(layer, f"is_{attr}_initialized", {}).get(idx, True)
    ]
    # (a state a layer never initialises, e.g. the recurrent state of a conv-only layer, is None: nothing to hold)
    if states and any(not isinstance(t, torch.Tensor) or t.shape[0] != batch for t in states):
        return (
            f"cache layer {name} did not allocate its conv/recurrent states with {batch} rows after a "
            f"forward; cannot build padded bucket views"
        )
    keys = getattr(layer, "keys", None)
    if isinstance(keys, torch.Tensor) and keys.shape[0] != batch:
        return f"cache layer {name} holds keys with {keys.shape[0]} rows, not {batch}; cannot build padded bucket views"
    return None


def cache_was_written(cache) -> bool:
    """True when a forward wrote ``cache``: an attention layer's write counter moved, or a linear-attention
    layer's ``has_previous_state`` flag is set. False for a model that ignores the cache it is given."""
    for layer in getattr(cache, "layers", None) or []:
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor) and counter.numel() == 1 and int(counter) > 0:
            return True
        if isinstance(counter, int) and counter > 0:
            return True
        flags = getattr(layer, "has_previous_state", None)
        if isinstance(flags, dict) and any(bool(v) for v in flags.values()):
            return True
        if flags is True:
            return True
    return False
