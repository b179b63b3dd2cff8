"""The varlen step of transformers' continuous batching as graphrunner captures it: its dims, its inputs, its forward.

:func:`batch_dims` names a model's dims (``tokens``, one keys dim per
attention type, ``reqs``); :func:`cache_groups` reads the paged cache's
allocators (:class:`CacheGroup`: trash slots, real slot range, window);
:func:`step_inputs` declares every metadata tensor as a
:class:`~graphrunner.BatchInput` with bounds and a pad; :func:`make_step` is
the forward a :class:`~graphrunner.GraphRunner` captures, which builds the
attention masks in the graph from integer coordinates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from graphrunner.errors import CaptureError
from graphrunner.hf.attention import per_request_mask, routed
from graphrunner.hf.internals import allocator_layout
from graphrunner.inputs import BatchInput

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

__all__ = [
    "DIMS",
    "KEY_PAD_REQUEST",
    "TOKEN_PAD_REQUEST",
    "CacheGroup",
    "attends_per_request",
    "batch_dims",
    "cache_groups",
    "for_dim",
    "kv_dim",
    "make_step",
    "step_inputs",
]

T = TypeVar("T")

#: Pad of ``tok_req`` (a padding query's request): no key carries it.
TOKEN_PAD_REQUEST = -1
#: Pad of ``key_req`` (a padding key's request): below every real query's range of allowed keys.
KEY_PAD_REQUEST = -2

#: The dims of a model with one attention type.
DIMS = ("tokens", "kv", "reqs")


def kv_dim(layer_type: str, layer_types: Sequence[str]) -> str:
    """The name of the keys dim of ``layer_type``'s layers among the model's ``layer_types``: ``kv`` for the
    full-attention layers or the only type, else ``kv_<type>`` (``kv_sliding`` for ``sliding_attention``)."""
    if len(set(layer_types)) == 1 or layer_type == "full_attention":
        return "kv"
    return "kv_" + layer_type.replace("_attention", "")


def for_dim(per_dim: Mapping[str, T], dim: str, default: T | None = None) -> T:
    """``per_dim[dim]``; for a keys dim not named (``kv_sliding``), ``per_dim["kv"]``: the one rule by which
    ``kv`` stands for every keys dim an option does not name. ``default`` when neither is there (``KeyError``
    without one)."""
    if dim in per_dim:
        return per_dim[dim]
    if dim.startswith("kv") and "kv" in per_dim:
        return per_dim["kv"]
    if default is None:
        raise KeyError(dim)
    return default


def batch_dims(model: PreTrainedModel) -> tuple[str, ...]:
    """The step's dims for ``model``: ``("tokens", <one keys dim per attention type>, "reqs")``, the keys dims
    as :func:`kv_dim` names them, ``kv`` first. Each attention type reads its own keys (a sliding
    layer only its window), so each is padded to its own bucket. ``DIMS`` for a model transformers'
    paged cache cannot group (one it refuses)."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    config = getattr(model, "config", None)
    if config is None:
        return DIMS
    try:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        types = list(group_layers_by_attn_type(text))
    except (ValueError, AttributeError, TypeError):
        return DIMS
    return ("tokens", *sorted({kv_dim(t, types) for t in types}, key=_kv_order), "reqs")


def _kv_order(dim: str) -> tuple[bool, str]:
    """The order of the keys dims in a key: ``kv`` first, then by name."""
    return dim != "kv", dim


@dataclass
class CacheGroup:
    """One cache allocator (an attention type) as the step sees it."""

    index: int
    layer_type: str
    dim: str
    write_trash: int
    read_trash: int
    sentinel: int
    first_real: int
    last_index: int
    write_sector: int
    window: int | None


def cache_groups(cache: PagedAttentionCache) -> list[CacheGroup]:
    """The cache's allocators: their trash, sentinel and real index ranges, and sliding windows."""
    out = []
    types = list(cache.cache_allocators)
    for layer_type, alloc in cache.cache_allocators.items():
        lay = allocator_layout(alloc, sliding=layer_type == "sliding_attention")
        out.append(
            CacheGroup(
                index=lay.index,
                layer_type=layer_type,
                dim=kv_dim(layer_type, types),
                write_trash=lay.write_trash,
                read_trash=lay.read_trash,
                sentinel=lay.sentinel,
                first_real=2 * lay.sector,
                last_index=lay.last_index,
                write_sector=lay.sector,
                window=lay.window,
            )
        )
    return sorted(out, key=lambda g: _kv_order(g.dim))


def step_inputs(
    groups: Sequence[CacheGroup], vocab_size: int, max_position: int, max_requests: int, max_tokens: int
) -> dict[str, BatchInput]:
    """The :class:`~graphrunner.BatchInput` of every metadata tensor of the step, with bounds and pads.

    ``tokens`` dim: ``input_ids``, ``position_ids``, ``tok_req`` (each query token's request) and
    ``write_index_<i>`` per allocator (pad: the write-trash slot). The allocator's keys dim (``kv``,
    ``kv_sliding``: :func:`kv_dim`): ``read_index_<i>`` (pad: the read-trash slot), ``key_req_<i>`` and
    ``key_pos_<i>`` (each key's request and position). ``reqs`` dim: ``logits_indices``."""
    tokens, reqs = ("tokens",), ("reqs",)
    spec = {
        "input_ids": BatchInput(dtype=torch.int32, dims=tokens, pad=0, bounds=(0, vocab_size - 1)),
        "position_ids": BatchInput(dtype=torch.int32, dims=tokens, pad=0, bounds=(0, max_position - 1)),
        "tok_req": BatchInput(dtype=torch.int32, dims=tokens, pad=TOKEN_PAD_REQUEST, bounds=(0, max_requests - 1)),
        "logits_indices": BatchInput(dtype=torch.int32, dims=reqs, pad=0, bounds=(0, max_tokens - 1)),
    }
    for g in groups:
        # sliding layers read a sentinel slot (and write the write trash for tokens beyond the window)
        lo_read = g.sentinel if g.window is not None else g.first_real
        lo_write = g.write_sector if g.window is not None else g.first_real
        kv = (g.dim,)
        spec[f"write_index_{g.index}"] = BatchInput(
            dtype=torch.int64, dims=tokens, pad=g.write_trash, bounds=(lo_write, g.last_index)
        )
        spec[f"read_index_{g.index}"] = BatchInput(
            dtype=torch.int64, dims=kv, pad=g.read_trash, bounds=(lo_read, g.last_index)
        )
        spec[f"key_req_{g.index}"] = BatchInput(
            dtype=torch.int32, dims=kv, pad=KEY_PAD_REQUEST, bounds=(0, max_requests - 1)
        )
        spec[f"key_pos_{g.index}"] = BatchInput(dtype=torch.int32, dims=kv, pad=0, bounds=(0, max_position - 1))
    return spec


#: The forms of the step's attention (``BatchingOptions.attention``): ``auto`` is ``per_request`` where the
#: graphs are the CPU tape and ``dense`` where they are CUDA graphs (a real GPU or the CUDA stand-in).
ATTENTION_FORMS = ("auto", "per_request", "dense")


def attends_per_request(form: str, graphs_on_cuda: bool) -> bool:
    """Whether the step's attention (``form``: one of :data:`ATTENTION_FORMS`) computes each request's queries
    against its own keys only (:func:`graphrunner.hf.attention.per_request_mask`), rather than over the dense
    ``[tokens, kv]`` masks that a CUDA graph replays. ``auto``: per request unless ``graphs_on_cuda`` (the
    per-request op reads the metadata on the host, which a CUDA stream capture cannot hold). Then a padding key
    costs the step no attention, only its gather. ``ValueError`` for another form."""
    if form not in ATTENTION_FORMS:
        raise ValueError(f"attention must be one of {list(ATTENTION_FORMS)}, got {form!r}")
    return form == "per_request" or (form == "auto" and not graphs_on_cuda)


def make_step(
    model: PreTrainedModel,
    cache: PagedAttentionCache | None,
    groups: Sequence[CacheGroup],
    use_logits_to_keep: bool,
    max_position: int = 1 << 20,
    max_requests: int = 1024,
    per_request: bool = True,
):
    """Return ``step(**metadata) -> logits [reqs, vocab]``: one varlen forward of ``model`` over the paged ``cache``.

    The attention mask of each attention type is built in the step: query token
    ``t`` may attend key ``j`` iff they belong to the same request, the key's
    position is at most the query's, and (sliding layers) within the window;
    masked cells hold ``-inf`` (transformers' ``build_attention_mask`` writes
    ``finfo.min``: the same softmax, bit for bit, on every row that attends a key,
    and CPU flash attention skips ``-inf`` blocks, 5-8% faster; a boolean mask
    would be converted to a float one in every layer). The test is one range
    check per cell on a code ``request * (max_position + 1) + position`` (int32 while twice the largest
    code fits): key ``j`` is allowed for ``t`` iff ``lo_t <= code_j <= hi_t`` with ``lo_t = code(t's request,
    lowest allowed position)`` and ``hi_t = code(t)``, computed as ``|2 code_j - (lo_t + hi_t)| <= hi_t - lo_t``
    (the same integers: one ``[tokens, kv]`` subtraction, an in-place ``abs_`` and one comparison, about
    20% cheaper than two comparisons and their ``&``). A padding key (request ``KEY_PAD_REQUEST``) is below every real query's
    range; a padding query (``TOKEN_PAD_REQUEST``) sees every key, so no row is fully
    masked (its softmax would be ``nan``; nothing reads a padding row).
    ``cu_seq_lens_*`` and ``max_length_*`` are placeholders: mask-based attention does not read them (they are validated at
    the call instead). ``max_position`` and ``max_requests`` bound the codes.

    The model's attention runs through :mod:`graphrunner.hf.attention` (transformers' attention dispatch; the
    model routed to it for the forward), which calls transformers' own function for the model's
    implementation (:func:`~graphrunner.hf.attention.routed` around the forward). With ``per_request`` each layer type's mask is passed in its per-request form
    (:func:`~graphrunner.hf.attention.per_request_mask`: the metadata, no cells), and each request's queries
    are computed against its own keys; without it the dense masks above are passed, built once per step in
    the graph: what CUDA graphs replay (the per-request op reads the metadata on the host, which a CUDA
    stream capture cannot hold)."""
    dtype = model.dtype
    single = len(groups) == 1
    big = int(max_position) + 1
    # 2 * code and lo + hi must fit too: twice the largest code below 2**31
    code_dtype = torch.int32 if 2 * (int(max_requests) + 2) * big < 2**31 else torch.int64
    lowest, highest = KEY_PAD_REQUEST * big, (int(max_requests) + 1) * big  # below / above every key's code
    by_index = sorted(groups, key=lambda g: g.index)
    if [g.index for g in by_index] != list(range(len(groups))):
        raise CaptureError(f"the cache's allocator indices {[g.index for g in by_index]} are not 0..{len(groups) - 1}")

    def step(input_ids, position_ids, tok_req, logits_indices, **per_group):
        # transformers indexes read_index / write_index by the allocator's index
        read = [per_group[f"read_index_{g.index}"] for g in by_index]
        write = [per_group[f"write_index_{g.index}"] for g in by_index]
        shared: dict[str, torch.Tensor] = {}

        def query_codes() -> dict[str, torch.Tensor]:
            if not shared:
                q_pos = position_ids.to(code_dtype)
                q_base = tok_req.to(code_dtype) * big
                pad_query = tok_req < 0
                shared.update(q_pos=q_pos, q_base=q_base, pad_query=pad_query)
                shared["q_code"] = torch.where(pad_query, highest, q_base + q_pos)[:, None]
                shared["zero"] = torch.zeros((), dtype=dtype, device=input_ids.device)
                shared["masked"] = torch.full((), float("-inf"), dtype=dtype, device=input_ids.device)
            return shared

        def dense_mask(g: CacheGroup) -> torch.Tensor:
            c = query_codes()
            q_base, q_pos, q_code = c["q_base"], c["q_pos"], c["q_code"]
            k_code2 = (
                (per_group[f"key_req_{g.index}"].to(code_dtype) * big + per_group[f"key_pos_{g.index}"].to(code_dtype))
                * 2
            )[None, :]
            lo = q_base if g.window is None else torch.maximum(q_base, q_base + q_pos - (g.window - 1))
            lo = torch.where(c["pad_query"], lowest, lo)[:, None]
            # lo <= code <= hi  <=>  |2 code - (lo + hi)| <= hi - lo  (integers: exact)
            allowed = torch.sub(k_code2, lo + q_code).abs_() <= (q_code - lo)
            return torch.where(allowed, c["zero"], c["masked"])[None, None]

        masks = {
            g.layer_type: per_request_mask(
                tok_req, position_ids, per_group[f"key_req_{g.index}"], per_group[f"key_pos_{g.index}"], g.window
            )
            if per_request
            else dense_mask(g)
            for g in groups
        }
        n_tok = input_ids.shape[0]
        # a no-op for a validated call; keeps the step total on whatever a background capture's warmup reads
        # (the static buffers still hold a larger call's rows: a logits index past this key's tokens)
        logits_indices = logits_indices.clamp(0, n_tok - 1)
        placeholder = torch.zeros(logits_indices.shape[0] + 1, dtype=torch.int32, device=input_ids.device)
        kwargs = dict(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            attention_mask=next(iter(masks.values())) if single else masks,
            cu_seq_lens_q=placeholder,
            max_length_q=n_tok,
            cu_seq_lens_k={g.layer_type: placeholder for g in groups},
            max_length_k={g.layer_type: per_group[f"read_index_{g.index}"].shape[0] for g in groups},
            read_index=read,
            write_index=write,
            logits_indices=logits_indices,
            cache=cache,
            block_table=None,
            use_cache=False,
            is_causal=False,
        )
        if use_logits_to_keep:
            kwargs["logits_to_keep"] = logits_indices
        # the dense masks need no routing: the model's own attention function reads them as transformers' do
        with routed(model) if per_request else contextlib.nullcontext():
            logits = model(**kwargs).logits
        if not use_logits_to_keep:
            logits = logits[:, logits_indices.long(), :]
        return logits[0]

    return step
