"""Hugging Face causal LMs: greedy decoding with a graph-captured one-token step (``gr.hf``).

Needs ``transformers`` (the ``hf`` extra); ``import graphrunner`` does not.
:class:`DecodeRunner` builds a ``transformers.StaticCache`` of ``max_batch``
rows, captures the one-token greedy decode step per batch bucket through
:class:`graphrunner.GraphRunner` on the *empty* cache, then zeroes the cache
in place (the graphs hold its tensors' addresses; the capture protocol's
eager warmups really write K/V and advance the write counter).

Two kinds of cache layer are handled. Attention models (Llama, ...) get
``StaticLayer`` objects: ``keys``/``values`` ``[B, heads, max_cache_len, dim]`` and,
on transformers 5.x, a write-counter tensor. Mamba gets
``LinearAttentionLayer`` objects: per layer a ``conv_states[0]`` ``[B, channels,
kernel]`` and a ``recurrent_states[0]`` ``[B, channels, state]``, both updated
in place by the decode step (``copy_``), plus a Python flag
``has_previous_state`` that picks the mixer's branch (prefill or one-token
update). The graphs are captured with the flag set (the branch every decode
step takes after a prefill) on zeroed states; zeroing the cache
(:func:`zero_cache`) also clears the flag so that the next eager prefill
starts from no state, exactly as ``model.generate`` does.

Padded buckets: every bucket ``b`` gets its own cache object whose per-layer
state tensors (``keys``/``values``, or ``conv_states``/``recurrent_states``)
are the views ``[:b]`` of the one ``max_batch`` cache (and whose write counter
and flags are the same objects), so the graph for bucket ``b`` reads and
writes rows ``[0, b)``. A batch of ``n < b`` rows is prefilled into rows
``[0, n)``; rows ``[n, b)`` hold zeros (the cache is zeroed before every
:meth:`DecodeRunner.generate`) and decode pad token 0 at position 0, which
keeps them finite. Attention, norms, per-token MoE routing and Mamba's
per-row convolution and state update never mix rows, so padding rows never
affect real rows.

The lower-level helpers (:func:`make_static_cache`, :func:`cache_tensors`,
:func:`snapshot_cache`, :func:`restore_cache`, :func:`compare_caches`,
:func:`prefill`, :func:`make_decode_step`, :func:`decode_inputs`) are public
for tools that drive the cache themselves (``examples/hf_llama.py``).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from graphrunner.buckets import default_buckets, validate_buckets
from graphrunner.devices import get_device
from graphrunner.errors import CaptureError, GraphRunnerError
from graphrunner.runner import BatchInput, GraphRunner

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("graphrunner.hf needs transformers: pip install 'graphrunner[hf]' "
                      "(or pip install transformers)") from exc

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "DecodeRunner",
    "make_static_cache",
    "cache_tensors",
    "snapshot_cache",
    "restore_cache",
    "zero_cache",
    "compare_caches",
    "prefill",
    "make_decode_step",
    "decode_inputs",
]

#: ``config.model_type`` values whose decode step :class:`DecodeRunner` captures and
#: has tested against ``model.generate(..., cache_implementation="static")``. The Mamba types keep
#: conv/recurrent states in the StaticCache's linear-attention layers; their default cache holds the same
#: layers, so plain ``model.generate(...)`` gives the same tokens too (tested).
#: The transformers major version whose cache layout DecodeRunner was verified against.
VERIFIED_TRANSFORMERS_MAJOR = 5


def _transformers_version() -> str:
    """The installed transformers' version string."""
    return str(getattr(transformers, "__version__", "0"))


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "phi3", "mixtral", "mamba", "mamba2")

#: Per-layer dicts ``{state_idx: tensor}`` of a transformers linear-attention (Mamba) cache layer.
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
    kwargs: Dict[str, Any] = {"config": model.config, "max_cache_len": max_cache_len}
    if "max_batch_size" in params:
        kwargs["max_batch_size"] = batch_size
    elif "batch_size" in params:
        kwargs["batch_size"] = batch_size
    if "device" in params:
        kwargs["device"] = model.device
    if "dtype" in params:
        kwargs["dtype"] = model.dtype
    return StaticCache(**kwargs)


def cache_tensors(cache) -> Dict[str, torch.Tensor]:
    """Return every tensor a ``StaticCache`` holds, by a readable name.

    On ``transformers`` >= 4.56 these are the tensor attributes of each layer
    in ``cache.layers`` (``keys``, ``values`` and, on 5.x, the write counter
    ``cumulative_length``) and, for linear-attention (Mamba) layers, the
    tensors of its ``conv_states``/``recurrent_states`` dicts (named
    ``layers[i].conv_states[0]``); on older versions the ``key_cache`` and
    ``value_cache`` lists. Raises ``ValueError`` if the cache holds none
    (not yet allocated: prefill it first).
    """
    out: Dict[str, torch.Tensor] = {}
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


def snapshot_cache(cache) -> Dict[str, torch.Tensor]:
    """Return clones of every cache tensor (see :func:`cache_tensors`)."""
    return {name: t.clone() for name, t in cache_tensors(cache).items()}


def restore_cache(cache, snapshot: Dict[str, torch.Tensor]) -> None:
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
    _zero_tensors(cache)
    for layer in getattr(cache, "layers", None) or []:
        flags = getattr(layer, "has_previous_state", None)
        if isinstance(flags, dict):
            for idx in flags:
                flags[idx] = False


def _zero_tensors(cache) -> None:
    """Zero every cache tensor in place; Python flags untouched."""
    for t in cache_tensors(cache).values():
        t.zero_()


def compare_caches(got, want) -> List[str]:
    """Return one line per cache tensor of ``got`` that is not ``torch.equal`` to ``want``'s (empty: equal)."""
    g, w = cache_tensors(got), cache_tensors(want)
    if g.keys() != w.keys():
        return [f"cache tensor names differ: {sorted(g)} vs {sorted(w)}"]
    bad = []
    for name in g:
        if not torch.equal(g[name], w[name]):
            diff = ((g[name].double() - w[name].double()).abs().max().item()
                    if g[name].shape == w[name].shape else "shape")
            bad.append(f"{name}: max abs diff {diff}")
    return bad


def _forward_kwargs(model) -> Dict[str, Any]:
    params = inspect.signature(model.forward).parameters
    return {
        "cache": "cache" if "cache" in params else "past_key_values",
        "cache_position": "cache_position" in params,
    }


def prefill(model, cache, input_ids: torch.Tensor) -> torch.Tensor:
    """Run the prompt ``input_ids`` ``[B, P]`` eagerly through ``model``, writing ``cache``; return logits ``[B, P, V]``.

    Every row is at positions ``0..P-1`` (equal-length prompts).
    """
    names = _forward_kwargs(model)
    b, p = input_ids.shape
    positions = torch.arange(p, device=input_ids.device)
    kwargs = {names["cache"]: cache, "position_ids": positions.unsqueeze(0).expand(b, p), "use_cache": True}
    if names["cache_position"]:
        kwargs["cache_position"] = positions
    return model(input_ids=input_ids, **kwargs).logits


def make_decode_step(model, cache) -> Callable[..., torch.Tensor]:
    """Return ``step(input_ids, position_ids) -> logits``: one decode token per row through ``cache``.

    ``input_ids`` and ``position_ids`` are ``[B, 1]`` long tensors (row 0 gives
    the write position; all real rows share it); the result is the
    ``[B, 1, vocab]`` logits tensor (only tensors may leave a captured
    forward, so the ``ModelOutput`` and the cache object stay inside).
    ``cache`` is one cache, or a callable ``cache(batch) -> cache`` choosing
    one per batch size (as :class:`DecodeRunner` does for its buckets). The
    step writes the cache in place and holds no Python state that changes
    between calls, so it can be captured.
    """
    names = _forward_kwargs(model)
    pick = cache if callable(cache) else (lambda _batch: cache)

    def step(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        kwargs = {names["cache"]: pick(input_ids.shape[0]), "position_ids": position_ids, "use_cache": True}
        if names["cache_position"]:
            kwargs["cache_position"] = position_ids[0]  # a view: rows share one position
        return model(input_ids=input_ids, **kwargs).logits

    return step


def decode_inputs(vocab_size: Optional[int] = None, max_cache_len: Optional[int] = None) -> Dict[str, Any]:
    """Return the GraphRunner input spec of the decode step: ``input_ids`` and ``position_ids``, both ``[B, 1]`` long.

    ``vocab_size`` and ``max_cache_len``, when given, become the inputs' ``bounds`` (the padding
    check at capture draws real token ids and positions from them)."""
    return {
        "input_ids": BatchInput(trailing=(1,), dtype=torch.long, pad=0,
                                bounds=None if vocab_size is None else (0, int(vocab_size) - 1)),
        "position_ids": BatchInput(trailing=(1,), dtype=torch.long, pad=0,
                                   bounds=None if max_cache_len is None else (0, int(max_cache_len) - 1)),
    }


def _row_view_cache(cache, rows: int):
    """A shallow copy of an allocated ``StaticCache`` whose layers see rows ``[0, rows)`` of ``cache``'s tensors.

    ``keys``/``values`` become the views ``[:rows]`` (same storage), and so do
    the tensors of a linear-attention layer's ``conv_states``/``recurrent_states``
    (new dicts of views); every other attribute (the write counter tensor, the
    ``has_previous_state`` flags dict) is the very same object, so resetting
    the full cache resets every view.
    """
    view = copy.copy(cache)
    layers = []
    for layer in cache.layers:
        lv = copy.copy(layer)
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                setattr(lv, name, t[:rows])
                if hasattr(lv, "batch_size"):
                    lv.batch_size = rows
        for name in _STATE_DICTS:
            states = getattr(layer, name, None)
            if isinstance(states, dict):
                setattr(lv, name, {idx: t[:rows] if isinstance(t, torch.Tensor) else t
                                   for idx, t in states.items()})
        layers.append(lv)
    view.layers = layers
    return view


class DecodeRunner:
    """Greedy decoding of a Hugging Face causal LM whose one-token step replays as a captured graph.

    ``DecodeRunner(model, max_batch, max_cache_len, buckets=None, backend="full", device="auto")``
    builds a ``StaticCache`` of ``max_batch`` rows and ``max_cache_len``
    positions for ``model`` (an eval-mode ``*ForCausalLM`` of a type in
    :data:`SUPPORTED_MODEL_TYPES`) and a :class:`GraphRunner` over the decode
    step with ``buckets`` (default: GraphRunner's default for ``max_batch``;
    the largest must be ``max_batch``). Nothing is captured until
    :meth:`capture` (or the first :meth:`generate`). ``backend`` and
    ``device`` are passed to :class:`GraphRunner`; the model must already be
    on that device. Raises ``ValueError`` for bad sizes.
    """

    def __init__(self, model, max_batch: int, max_cache_len: int, buckets: Optional[Sequence[int]] = None,
                 backend: Any = "full", device: Any = "auto") -> None:
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if not isinstance(max_cache_len, int) or max_cache_len < 2:
            raise ValueError(f"max_cache_len must be an int >= 2 (prompt + new tokens), got {max_cache_len!r}")
        if buckets is None:
            buckets = default_buckets(max_batch)
        buckets = validate_buckets(buckets)  # GraphRunner's rules, checked before anything is built
        if buckets[-1] != max_batch:
            raise ValueError(f"the largest bucket must equal max_batch={max_batch}, got buckets {buckets}: "
                             f"add {max_batch} or lower max_batch")
        self.model = model
        self.max_batch = max_batch
        self.max_cache_len = max_cache_len
        self.model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        self.device = get_device(device)
        self.cache = None
        self._views: Dict[int, Any] = {}
        self._report = None
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        vocab = getattr(emb, "num_embeddings", None)  # the padding check draws real token ids below it
        self.runner = GraphRunner(self._step, inputs=decode_inputs(vocab, max_cache_len), buckets=buckets, backend=backend,
                                  device=self.device, progress=False, fallback="error")
        self.buckets: List[int] = list(self.runner.buckets)

    # ------------------------------------------------------------------ internals
    def _view(self, rows: int):
        if rows not in self._views:
            self._views[rows] = _row_view_cache(self.cache, rows)
        return self._views[rows]

    def _step(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self._decode(input_ids=input_ids, position_ids=position_ids)

    def _check_architecture(self) -> None:
        version = _transformers_version()
        head = version.split(".")[0]
        if not head.isdigit() or int(head) < VERIFIED_TRANSFORMERS_MAJOR:
            raise CaptureError(f"gr.hf.DecodeRunner is verified on transformers {VERIFIED_TRANSFORMERS_MAJOR}.x, found "
                               f"{version}: older versions keep cache state in other objects "
                               f"(e.g. MambaCache), which the graphs would not reset. Upgrade with "
                               f"pip install 'graphrunner[hf]', or decode with model.generate()")
        mt = self.model_type
        if mt not in SUPPORTED_MODEL_TYPES:
            raise CaptureError(f"gr.hf.DecodeRunner has not verified architecture {mt!r} (config.model_type): "
                               f"its decode step may keep state outside a StaticCache or need per-row positions, "
                               f"so a replay could give wrong tokens. Supported: {', '.join(SUPPORTED_MODEL_TYPES)}; "
                               f"decode other models eagerly with model.generate()")

    def _allocate(self) -> None:
        """Allocate the ``max_batch`` cache with one eager dummy token, then zero it (an empty cache)."""
        self.cache = make_static_cache(self.model, self.max_batch, self.max_cache_len)
        self._decode = make_decode_step(self.model, self._view)
        dev = self.model.device
        prefill(self.model, self.cache, torch.zeros((self.max_batch, 1), dtype=torch.long, device=dev))
        try:
            cache_tensors(self.cache)
        except ValueError as exc:
            raise CaptureError(f"architecture {self.model_type!r}: the StaticCache stayed empty after a forward; "
                               f"the model does not use it, so its decode step cannot be captured") from exc
        if getattr(self.cache, "layers", None) is None:
            raise CaptureError(f"architecture {self.model_type!r}: this transformers version's StaticCache has no "
                               f"per-layer objects (transformers >= 4.56 needed for padded buckets); upgrade it")
        for layer in self.cache.layers:
            if type(layer).__name__ == "LinearAttentionLayer":
                self._check_linear_layer(layer)
                continue
            if getattr(layer, "is_sliding", False) and type(layer).__name__ != "StaticLayer":
                raise CaptureError(f"architecture {self.model_type!r}: sliding-window cache layers keep a Python "
                                   f"write counter a graph cannot replay; set config.sliding_window=None or use "
                                   f"model.generate()")
            if getattr(layer, "keys", None) is None or layer.keys.shape[0] != self.max_batch:
                raise CaptureError(f"architecture {self.model_type!r}: unexpected StaticCache layer "
                                   f"{type(layer).__name__}; cannot build padded bucket views")
        # Zero the tensors but keep linear-attention layers' has_previous_state set, so that every warmup and
        # the capture run the one-token update branch that each decode step after a prefill takes (with the
        # flag cleared by zero_cache, the first warmup would run the prefill branch instead).
        _zero_tensors(self.cache)

    def _check_linear_layer(self, layer) -> None:
        """Refuse a linear-attention (Mamba) cache layer whose state a graph could not hold in place."""
        if getattr(layer, "record_past", False):
            raise CaptureError(f"architecture {self.model_type!r}: a linear-attention cache layer records its past "
                               f"(activate_past_recording), so its conv state grows and is reassigned instead of "
                               f"updated in place; a graph would write a stale tensor. Do not record the past")
        states = [t for name in _STATE_DICTS for t in getattr(layer, name).values()]
        if not states or any(not isinstance(t, torch.Tensor) or t.shape[0] != self.max_batch for t in states):
            raise CaptureError(f"architecture {self.model_type!r}: a linear-attention cache layer did not allocate "
                               f"its conv/recurrent states with {self.max_batch} rows after a forward; "
                               f"cannot build padded bucket views")

    # ------------------------------------------------------------------ API
    def capture(self):
        """Capture the decode step for every bucket on the empty cache; return GraphRunner's ``CaptureReport``.

        Raises :class:`CaptureError` naming the architecture and the reason
        when the model cannot be captured safely (unsupported
        ``config.model_type``, no StaticCache, sliding-window layers, or an
        op that a graph cannot hold). After capture the cache is zeroed in
        place, undoing the warmups' writes. Calling it again returns the
        first report.
        """
        if self._report is not None:
            return self._report
        self._check_architecture()
        with torch.inference_mode():
            self._allocate()
            try:
                self._report = self.runner.capture()
            except GraphRunnerError as exc:
                raise CaptureError(f"gr.hf.DecodeRunner could not capture the decode step of architecture "
                                   f"{self.model_type!r}: {exc}") from exc
            finally:
                self._reset_cache()
        return self._report

    def _reset_cache(self) -> None:
        """Empty the cache in place (the graphs keep the same tensors): after capture, undoing the warmups'
        K/V and state writes and write-counter advances, and before every :meth:`generate` (which also clears
        Mamba's ``has_previous_state`` so the eager prefill starts from no state; see :func:`zero_cache`)."""
        zero_cache(self.cache)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int,
                 attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Greedy decoding: return ``[B, P + max_new_tokens]`` tokens, the prompt then the new ones.

        ``input_ids`` is a ``[B, P]`` long tensor of equal-length prompts,
        ``1 <= B <= max_batch``; ``attention_mask``, if given, must be all
        ones (padded prompts are not supported). The prompt is prefilled
        eagerly into rows ``[0, B)`` of the zeroed cache, then each new token
        comes from a graph replay of the bucket holding ``B``. Equals
        ``model.generate(input_ids, max_new_tokens=..., do_sample=False,
        cache_implementation="static")`` token for token, EOS handling included
        (the model's ``generation_config`` ``eos_token_id``/``pad_token_id``:
        a finished row continues with pad, and decoding stops early, with a
        shorter result, once every row has finished).
        Captures first if :meth:`capture` was not called. Raises
        ``ValueError`` for bad shapes or when ``P + max_new_tokens - 1``
        exceeds ``max_cache_len``.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError("input_ids must be a [batch, prompt_len] torch.long tensor")
        b, p = input_ids.shape
        if not 1 <= b <= self.max_batch or p < 1:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: need 1 <= batch <= max_batch="
                             f"{self.max_batch} and prompt_len >= 1")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if p + max(max_new_tokens - 1, 0) > self.max_cache_len:
            raise ValueError(f"prompt_len {p} + max_new_tokens {max_new_tokens} - 1 exceeds max_cache_len "
                             f"{self.max_cache_len}: build the DecodeRunner with a larger max_cache_len")
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            raise ValueError("attention_mask has zeros: DecodeRunner.generate supports equal-length, unpadded "
                             "prompts only; group prompts by length or use model.generate()")
        self.capture()
        dev = self.model.device
        input_ids = input_ids.to(dev)
        if max_new_tokens == 0:
            return input_ids.clone()
        with torch.inference_mode():
            self._reset_cache()
            logits = prefill(self.model, self._view(b), input_ids)
            eos, pad = self._eos_pad(dev)
            unfinished = torch.ones((b, 1), dtype=torch.bool, device=dev)
            out = [input_ids]
            for i in range(max_new_tokens):
                if i:
                    positions = torch.full((b, 1), p + i - 1, dtype=torch.long, device=dev)
                    logits = self.runner(input_ids=token, position_ids=positions)
                token = logits[:, -1].argmax(-1, keepdim=True)
                if eos is not None:
                    # As model.generate: a finished row emits pad; all finished -> stop early.
                    token = torch.where(unfinished, token, pad)
                    unfinished &= ~torch.isin(token, eos)
                out.append(token)
                if eos is not None and not bool(unfinished.any()):
                    break
        return torch.cat(out, dim=1)

    def _eos_pad(self, dev):
        """``(eos ids tensor or None, pad id tensor)`` from the model's generation config, as ``model.generate`` uses."""
        gc = getattr(self.model, "generation_config", None)
        eos = getattr(gc, "eos_token_id", None)
        if eos is None:
            return None, None
        eos_list = [eos] if isinstance(eos, int) else list(eos)
        if not eos_list:
            return None, None
        pad = getattr(gc, "pad_token_id", None)
        if pad is None:
            pad = eos_list[0]
        return (torch.tensor(eos_list, dtype=torch.long, device=dev),
                torch.tensor(pad, dtype=torch.long, device=dev))

    def cleanup(self) -> None:
        """Release the captured graphs (``GraphRunner.cleanup``); the runner cannot replay afterwards."""
        self.runner.cleanup()

    def __repr__(self) -> str:
        return (f"DecodeRunner(model_type={self.model_type!r}, max_batch={self.max_batch}, "
                f"max_cache_len={self.max_cache_len}, buckets={self.buckets}, captured={self._report is not None})")
