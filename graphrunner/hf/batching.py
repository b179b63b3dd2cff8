"""transformers' continuous batching (``model.generate_batch``) with its model step served by graphrunner graphs.

transformers (>= 5) ships a continuous-batching engine: a scheduler that mixes
prefills and decodes of many requests in one varlen step, a paged KV cache
(:class:`~transformers.generation.continuous_batching.cache.PagedAttentionCache`)
and per-step metadata tensors (``cu_seq_lens_q/k``, ``read_index``,
``write_index``, ``logits_indices``, a block-diagonal attention mask). One
method runs the model for a step: ``ModelRunner.compute_batch(model,
batch_data)`` (forward, logits processors, sampling into ``output_ids``).

:func:`generate_batch` (and :class:`GraphBatching` under it) substitutes that
one method. Everything else is transformers' own code: the manager, the
scheduler, the cache and its allocators, ``prepare_batch_tensors`` (which
builds the metadata), the logits processors and the sampler. The forward of
each varlen step goes through one :class:`graphrunner.GraphRunner` with three
named dims, ``tokens`` (query tokens), ``kv`` (keys read, per attention type,
the longest of them) and ``reqs`` (requests), whose inputs are the step's
metadata, each declared with bounds and a pad (the write index of a padding
token is the allocator's write-trash slot, which no request owns). The
attention mask is not an input: the step builds it in the graph from integer
coordinates (each token's request and position, each key's request and
position) that are derived from transformers' ``cu_seq_lens`` and validated
against them at every call. See ``docs/continuous-batching.md``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from graphrunner.errors import CaptureError, GraphRunnerError
from graphrunner.inputs import BatchInput
from graphrunner.planning import plan_buckets
from graphrunner.hf.ladder import ladder_keys, replan
from graphrunner.runner import GraphRunner

logger = logging.getLogger("graphrunner")

#: The attention implementations whose paged attention reads the step's attention mask (the ones served).
MASKED_IMPLEMENTATIONS = ("sdpa", "paged|sdpa", "paged|eager", "eager")

#: Pad of ``tok_req`` (a padding query's request): no key carries it.
TOKEN_PAD_REQUEST = -1
#: Pad of ``key_req`` (a padding key's request): below every real query's range of allowed keys.
KEY_PAD_REQUEST = -2

#: Default graphs per dim for :func:`gr.plan_buckets <graphrunner.plan_buckets>` over the dry run's step sizes
#: (the ``kv`` limit holds for every attention type's keys dim).
DEFAULT_MAX_GRAPHS = {"tokens": 8, "kv": 8, "reqs": 4}

#: The dims of a model with one attention type.
_DIMS = ("tokens", "kv", "reqs")


def kv_dim(layer_type: str, layer_types: Sequence[str]) -> str:
    """The name of the keys dim of ``layer_type``'s layers among the model's ``layer_types``: ``kv`` for the
    full-attention layers or the only type, else ``kv_<type>`` (``kv_sliding`` for ``sliding_attention``)."""
    if len(set(layer_types)) == 1 or layer_type == "full_attention":
        return "kv"
    return "kv_" + layer_type.replace("_attention", "")


def batch_dims(model) -> Tuple[str, ...]:
    """The step's dims for ``model``: ``("tokens", <one keys dim per attention type>, "reqs")``, the keys dims
    as :func:`kv_dim` names them, ``kv`` first. Each attention type reads its own keys (a sliding
    layer only its window), so each is padded to its own bucket. ``_DIMS`` for a model transformers'
    paged cache cannot group (one it refuses)."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    config = getattr(model, "config", None)
    try:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        types = list(group_layers_by_attn_type(text))
    except (ValueError, AttributeError, TypeError):
        return _DIMS
    return ("tokens", *sorted({kv_dim(t, types) for t in types}, key=_kv_order), "reqs")


def _kv_order(dim: str) -> Tuple[bool, str]:
    """The order of the keys dims in a key: ``kv`` first, then by name."""
    return dim != "kv", dim


class MetadataError(GraphRunnerError, ValueError):
    """A step's metadata breaks the contract of :func:`generate_batch` (a stale or inconsistent
    ``cu_seq_lens``, a write index outside the cache, ...): raised at the call, before anything is replayed."""


@dataclass
class BatchingStats:
    """What a :class:`GraphBatching` served: ``steps`` (forward steps), ``replayed`` (served by a graph),
    ``eager_steps`` (served eagerly: GraphRunner fallbacks, steps before capture, decode fast-path steps),
    ``real_tokens`` / ``padded_tokens`` (query tokens of replayed steps: real, and padding the graphs computed),
    ``real_keys`` / ``padded_keys`` (the same for the ``kv`` dim),
    ``graphs`` (keys captured), ``capture_seconds``, ``dry_run_seconds`` (the planning run of the scheduler),
    ``step_sizes`` (``(tokens, kv..., reqs)``: a size per dim of :func:`batch_dims`, of every varlen step seen, dry run included), ``engine_sizes``
    (the same steps as transformers' own graph keys count them: ``(query tokens, max_kv_read, max_length_k
    per attention type)``, unpadded), ``keys`` (the keys captured) and ``equivalence_checked`` (keys the
    equivalence check replayed)."""

    steps: int = 0
    replayed: int = 0
    eager_steps: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    real_keys: int = 0
    padded_keys: int = 0
    graphs: int = 0
    capture_seconds: float = 0.0
    dry_run_seconds: float = 0.0
    step_sizes: List[Tuple[int, ...]] = field(default_factory=list)
    engine_sizes: List[Tuple[int, int, Tuple[int, ...]]] = field(default_factory=list)
    keys: List[Tuple[int, ...]] = field(default_factory=list)
    equivalence_checked: int = 0
    replans: int = 0

    def to_dict(self) -> Dict[str, Any]:
        """The counters as plain Python values (for JSON)."""
        return {"steps": self.steps, "replayed": self.replayed, "eager_steps": self.eager_steps,
                "real_tokens": self.real_tokens, "padded_tokens": self.padded_tokens, "real_keys": self.real_keys,
                "padded_keys": self.padded_keys, "graphs": self.graphs,
                "capture_seconds": self.capture_seconds, "dry_run_seconds": self.dry_run_seconds,
                "keys": [list(k) for k in self.keys], "equivalence_checked": self.equivalence_checked}


# --------------------------------------------------------------------------- refusal


def refusal(model, continuous_batching_config=None) -> Optional[str]:
    """Why :func:`generate_batch` cannot serve ``model`` through graphs, or ``None`` when it can.

    Served: models whose continuous batching runs transformers' index-based paged
    cache with a mask-based attention (``sdpa``, ``eager`` / ``paged|eager``),
    synchronous batching, every layer a full- or sliding-attention layer.
    Refused: layers that keep a recurrent state per request (state-space / mamba,
    linear-attention, short-convolution, RG-LRU, RWKV and xLSTM layers of hybrid and
    state-space models), which the paged cache does not hold (it pages attention keys
    and values only): decided from the config's ``layer_types`` (else
    ``layers_block_type`` / ``block_types``), else its ``model_type`` when it names
    no layers, the reason naming the layer kind; flash attention (its varlen kernels
    take ``max_length_q/k`` as Python ints, which a graph would freeze, and the decode
    fast path's block table); asynchronous batching; and other layer types the paged
    cache has no allocator for."""
    import re

    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate_batch"):
        return f"{type(model).__name__} is not a transformers generation model (no config / generate_batch)"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    declared = next((list(map(str, v)) for v in (getattr(text, n, None) for n in
                                                  ("layer_types", "layers_block_type", "block_types"))
                     if isinstance(v, (list, tuple)) and v), [])
    stateful = r"mamba|ssm|linear|conv|recurrent|rwkv|lstm|hybrid|lru|delta|state"
    kinds = sorted({k for k in declared if k not in ("full_attention", "sliding_attention") and re.search(stateful, k)})
    if not declared and re.search(r"mamba|rwkv|lstm|ssm|recurrent", model_type):
        kinds = [model_type]  # a state-space / RNN model whose config names no layers (rwkv, xlstm)
    try:
        groups, no_allocator = group_layers_by_attn_type(text), None
    except ValueError as exc:
        groups, no_allocator = None, exc
    if kinds:
        names = " ".join(list(getattr(text, "__dict__", {})) + [model_type])
        family = next((label for pattern, label in (
            (r"mamba|ssm_", "mamba state-space"), (r"rwkv", "RWKV recurrent"), (r"lstm", "xLSTM recurrent"),
            (r"(^|\s)linear_", "linear-attention"), (r"(^|\s)lru_", "RG-LRU recurrent"),
            (r"conv_L_cache|conv_kernel|conv_states", "short-convolution")) if re.search(pattern, names)), "recurrent")
        why = (f"its {'/'.join(kinds)} layers ({family}) keep a recurrent state per request that transformers' paged "
               "cache does not hold (it pages attention keys and values only)")
        if no_allocator is not None:
            return (f"{why}: the paged cache has no allocator for its layer types {sorted(set(declared))} "
                    f"({no_allocator}), so continuous batching itself cannot run it")
        return (f"{why}: continuous batching takes them for full-attention layers, so it cannot build their cache "
                "or (given head counts) restarts that state at every step and returns wrong tokens without an error")
    impl = getattr(config, "_attn_implementation", None)
    if impl not in MASKED_IMPLEMENTATIONS:
        return (f"its attention implementation {impl!r} is not mask-based: flash varlen attention takes "
                "max_length_q/k as Python ints a graph would freeze (and a block table on its decode fast path); "
                "load the model with attn_implementation='sdpa' or 'eager' (a half-precision model also needs "
                "ContinuousBatchingConfig(auto_switch_to_flash=False): transformers switches it to flash otherwise)")
    if no_allocator is not None:
        layer_types = sorted(set(getattr(text, "layer_types", None) or []))
        return (f"transformers' paged cache has no allocator for its layer types {layer_types} ({no_allocator}): "
                "continuous batching itself cannot run it")
    if getattr(text, "kv_lora_rank", None) is not None:
        return "its latent (MLA) attention cache is not one of the index-based caches the step is written for"
    cb = continuous_batching_config
    if cb is not None and getattr(cb, "use_async_batching", None):
        return "asynchronous batching double-buffers the step's inputs; run it with use_async_batching=False"
    if not groups:
        return "it has no attention layers"
    return None


# --------------------------------------------------------------------------- the step and its inputs


@dataclass
class _Group:
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
    window: Optional[int]


def _groups(cache) -> List[_Group]:
    """The cache's allocators: their trash, sentinel and real index ranges, and sliding windows."""
    out = []
    types = list(cache.cache_allocators)
    for layer_type, alloc in cache.cache_allocators.items():
        views = list(getattr(alloc, "_kv_token_views", {}).values())
        if not views:
            raise CaptureError(f"cache allocator {type(alloc).__name__} ({layer_type}) keeps no per-token K/V views: "
                               "not an index-based paged cache")
        last = min(min(k.shape[0], v.shape[0]) for k, v in views) - 1
        sector = int(alloc.block_physical_stride) * int(alloc.blocks_per_sector)  # slots of one sector
        out.append(_Group(index=alloc.index, layer_type=layer_type, dim=kv_dim(layer_type, types),
                          write_trash=int(alloc.write_trash_index), read_trash=int(alloc.read_trash_index), sentinel=int(alloc.sentinel_index),
                          first_real=2 * sector, last_index=int(last), write_sector=sector,
                          window=getattr(alloc, "sliding_window", None) if layer_type == "sliding_attention" else None))
    return sorted(out, key=lambda g: _kv_order(g.dim))


def check_trash(cache, groups: Sequence[_Group]) -> None:
    """Raise :class:`CaptureError` unless every allocator's write-trash slot (the write index of every
    padding token) lies in the trash sectors that no request is ever given."""
    for g in groups:
        if not (g.write_sector <= g.write_trash < g.first_real):
            raise CaptureError(
                f"padding tokens of the {g.layer_type} layers would write cache slot {g.write_trash}, which is not "
                f"in the write-trash sector (slots {g.write_sector}..{g.first_real - 1}; real slots start at "
                f"{g.first_real}): a padding token would overwrite a real request's K/V. The allocator's "
                "write_trash_index must point into the write-trash sector")


def step_inputs(groups: Sequence[_Group], vocab_size: int, max_position: int, max_requests: int,
                max_tokens: int) -> Dict[str, BatchInput]:
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
        spec[f"write_index_{g.index}"] = BatchInput(dtype=torch.int64, dims=tokens, pad=g.write_trash,
                                                    bounds=(lo_write, g.last_index))
        spec[f"read_index_{g.index}"] = BatchInput(dtype=torch.int64, dims=kv, pad=g.read_trash,
                                                   bounds=(lo_read, g.last_index))
        spec[f"key_req_{g.index}"] = BatchInput(dtype=torch.int32, dims=kv, pad=KEY_PAD_REQUEST,
                                                bounds=(0, max_requests - 1))
        spec[f"key_pos_{g.index}"] = BatchInput(dtype=torch.int32, dims=kv, pad=0, bounds=(0, max_position - 1))
    return spec


def make_step(model, cache, groups: Sequence[_Group], use_logits_to_keep: bool, max_position: int = 1 << 20,
              max_requests: int = 1024):
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
    the call instead). ``max_position`` and ``max_requests`` bound the codes."""
    dtype = model.dtype
    single = len(groups) == 1
    big = int(max_position) + 1
    # 2 * code and lo + hi must fit too: twice the largest code below 2**31
    code_dtype = torch.int32 if 2 * (int(max_requests) + 2) * big < 2 ** 31 else torch.int64
    lowest, highest = KEY_PAD_REQUEST * big, (int(max_requests) + 1) * big  # below / above every key's code
    by_index = sorted(groups, key=lambda g: g.index)
    if [g.index for g in by_index] != list(range(len(groups))):
        raise CaptureError(f"the cache's allocator indices {[g.index for g in by_index]} are not 0..{len(groups) - 1}")

    def step(input_ids, position_ids, tok_req, logits_indices, **per_group):
        masks: Dict[str, torch.Tensor] = {}
        # transformers indexes read_index / write_index by the allocator's index
        read = [per_group[f"read_index_{g.index}"] for g in by_index]
        write = [per_group[f"write_index_{g.index}"] for g in by_index]
        q_pos = position_ids.to(code_dtype)
        q_base = tok_req.to(code_dtype) * big
        pad_query = tok_req < 0
        q_code = torch.where(pad_query, highest, q_base + q_pos)[:, None]
        zero = torch.zeros((), dtype=dtype, device=input_ids.device)
        masked = torch.full((), float("-inf"), dtype=dtype, device=input_ids.device)
        for g in groups:
            k_code2 = ((per_group[f"key_req_{g.index}"].to(code_dtype) * big
                        + per_group[f"key_pos_{g.index}"].to(code_dtype)) * 2)[None, :]
            lo = q_base if g.window is None else torch.maximum(q_base, q_base + q_pos - (g.window - 1))
            lo = torch.where(pad_query, lowest, lo)[:, None]
            # lo <= code <= hi  <=>  |2 code - (lo + hi)| <= hi - lo  (integers: exact)
            allowed = torch.sub(k_code2, lo + q_code).abs_() <= (q_code - lo)
            masks[g.layer_type] = torch.where(allowed, zero, masked)[None, None]
        n_tok = input_ids.shape[0]
        # a no-op for a validated call; keeps the step total on whatever a background capture's warmup reads
        # (the static buffers still hold a larger call's rows: a logits index past this key's tokens)
        logits_indices = logits_indices.clamp(0, n_tok - 1)
        placeholder = torch.zeros(logits_indices.shape[0] + 1, dtype=torch.int32, device=input_ids.device)
        kwargs = dict(
            input_ids=input_ids[None], position_ids=position_ids[None],
            attention_mask=next(iter(masks.values())) if single else masks,
            cu_seq_lens_q=placeholder, max_length_q=n_tok,
            cu_seq_lens_k={g.layer_type: placeholder for g in groups},
            max_length_k={g.layer_type: per_group[f"read_index_{g.index}"].shape[0] for g in groups},
            read_index=read, write_index=write, logits_indices=logits_indices, cache=cache,
            block_table=None, use_cache=False, is_causal=False,
        )
        if use_logits_to_keep:
            kwargs["logits_to_keep"] = logits_indices
            logits = model(**kwargs).logits
        else:
            logits = model(**kwargs).logits[:, logits_indices.long(), :]
        return logits[0]

    return step


# --------------------------------------------------------------------------- metadata from transformers' IO


def step_feeds(io, cache, groups: Sequence[_Group], debug: bool = False, validate: bool = True
               ) -> Dict[str, torch.Tensor]:
    """The step's inputs for the batch transformers prepared in ``io`` (a ``ContinuousBatchingIOs``), checked.

    Reads what ``prepare_batch_tensors`` wrote (``input_ids``, ``position_ids``,
    ``cumulative_seqlens_q/k``, ``write/read_index_storage``, ``logits_indices``)
    and derives each token's and key's request and position from the
    ``cu_seq_lens``. Raises :class:`MetadataError` naming the tensor when the
    metadata breaks the contract: ``cu_seq_lens_q`` must start at 0, grow by at
    least 1 per request and end at the number of query tokens, positions must
    be consecutive inside each request, ``cu_seq_lens_k`` must end at the keys
    read, ``logits_indices`` must be each sampled request's last token, and every
    write index of a real token must lie in the cache, not in the read trash.
    ``debug=True`` also rebuilds transformers' own attention mask from the
    derived coordinates and compares it (cost: one ``[tokens, kv]`` pass per type).
    ``validate=False`` skips the checks (unsafe: a stale ``cu_seq_lens`` then builds wrong masks silently)."""
    n_req = int(io.num_request_in_batch)
    n_tok = int(io.total_seqlen_q)
    if n_req < 1 or n_tok < 1:
        raise MetadataError(f"a step with {n_req} requests and {n_tok} query tokens: nothing to run")
    dev = io.input_ids.device
    # the per-request metadata is small: checked on the host, read once
    cu_q = io.cumulative_seqlens_q[: n_req + 1]
    cq = cu_q.tolist()
    lq = [b - a for a, b in zip(cq, cq[1:])]
    if validate and (cq[0] != 0 or min(lq) < 1 or cq[-1] != n_tok):
        raise MetadataError(f"cu_seq_lens_q {cq} is stale or inconsistent: it must start at 0, grow by at "
                            f"least 1 per request ({n_req} requests) and end at the step's {n_tok} query tokens")
    input_ids = io.input_ids[:n_tok]
    position_ids = io.position_ids[:n_tok]
    req_ids = torch.arange(n_req, dtype=torch.int32, device=dev)
    lens_q = torch.tensor(lq, device=dev)
    tok_req = torch.repeat_interleave(req_ids, lens_q, output_size=n_tok)
    starts = cu_q[:-1].long()
    first_q = position_ids[starts]  # each request's first query position
    pos = position_ids
    if validate and not torch.equal(pos.long(), (first_q - starts)[tok_req] + torch.arange(n_tok, device=dev)):
        raise MetadataError("cu_seq_lens_q is stale or inconsistent with position_ids: positions are not consecutive "
                            f"inside a request (cu_seq_lens_q {cq})")
    expected = [cq[i + 1] - 1 for i, fs in enumerate(io.requests_in_batch) if fs.has_new_token]
    if validate and io.logits_indices[: len(expected)].tolist() != expected:
        raise MetadataError(f"logits_indices {io.logits_indices[:n_req].tolist()} do not point at the last token of "
                            f"each sampled request (expected {expected} from cu_seq_lens_q)")
    logits_indices = io.logits_indices[:n_req]
    feeds: Dict[str, torch.Tensor] = {"input_ids": input_ids, "position_ids": position_ids,
                                      "tok_req": tok_req, "logits_indices": logits_indices}
    reads_cache = int(io.max_kv_read) > 0
    fq = None
    for g in groups:
        cu_k = io.cumulative_seqlens_k[g.layer_type][: n_req + 1]
        ck = cu_k.tolist()
        lk = [b - a for a, b in zip(ck, ck[1:])]
        n_key = ck[-1]
        if validate and (ck[0] != 0 or any(k < q for k, q in zip(lk, lq))
                         or n_key != int(io.total_seqlen_k[g.layer_type])):
            raise MetadataError(f"cu_seq_lens_k[{g.layer_type!r}] {ck} is stale or inconsistent: it must "
                                "start at 0, give each request at least its query tokens and end at the keys read "
                                f"({io.total_seqlen_k[g.layer_type]})")
        write = io.write_index_storage[g.index, :n_tok]
        if validate and int(io.true_write_sizes[g.index]) != n_tok:
            raise MetadataError(f"write_index[{g.index}] has {io.true_write_sizes[g.index]} entries for {n_tok} tokens")
        if reads_cache:
            if validate and int(io.true_read_sizes[g.index]) != n_key:
                raise MetadataError(f"read_index[{g.index}] has {io.true_read_sizes[g.index]} entries, cu_seq_lens_k "
                                    f"[{g.layer_type!r}] says {n_key}")
            read = io.read_index_storage[g.index, :n_key]
        else:
            # no request reads its past (all first prefill chunks): read the step's own keys back, as the
            # allocator would index them (full layers: the written slots; sliding layers: sentinels)
            fq = first_q.tolist() if fq is None else fq
            if validate and any(fq):
                raise MetadataError("a step without cache reads (max_kv_read 0) holds a request that does not start "
                                    "at position 0")
            alloc = cache.cache_allocators[g.layer_type]
            idx: List[int] = []
            for fs in io.requests_in_batch:
                idx.extend(alloc.get_read_indices(fs.state.request_id, 0, fs.query_length))
            read = torch.tensor(idx, dtype=torch.int64, device=dev)
            if validate and read.shape[0] != n_key:
                raise MetadataError(f"{read.shape[0]} keys rebuilt for the {g.layer_type} layers, cu_seq_lens_k says "
                                    f"{n_key}")
        key_req = torch.repeat_interleave(req_ids, torch.tensor(lk, device=dev), output_size=n_key)
        # key j of request r sits at position first_q[r] - (lk[r] - lq[r]) + (j - ck[r]): j minus an offset per request
        offset = cu_k[:-1] - first_q + torch.tensor([k - q for k, q in zip(lk, lq)], dtype=first_q.dtype, device=dev)
        key_pos = torch.arange(n_key, dtype=torch.int32, device=dev) - offset.to(torch.int32)[key_req]
        if validate:
            # full layers: every real token's K/V is kept; sliding layers: tokens beyond the window go to the write trash
            lo = g.write_sector if g.window is not None else g.first_real
            w_lo, w_hi = (int(v) for v in torch.aminmax(write))
            if w_lo < lo or w_hi > g.last_index:
                raise MetadataError(f"write_index[{g.index}] ({g.layer_type}) holds {write.tolist()}: a real token must "
                                    f"write a slot in {lo}..{g.last_index}, never a trash slot (sliding layers: the "
                                    "write trash only) or outside the cache")
        feeds[f"write_index_{g.index}"] = write  # each attention type's keys: its own dim, its own length
        feeds[f"read_index_{g.index}"] = read
        feeds[f"key_req_{g.index}"] = key_req
        feeds[f"key_pos_{g.index}"] = key_pos
        if debug and io.attention_mask is not None:
            _compare_mask(io, g, tok_req, pos, key_req, key_pos, n_tok)
    return feeds


def _compare_mask(io, g: _Group, tok_req, pos, key_req, key_pos, n_tok: int) -> None:
    """Debug: the mask the step builds must allow exactly what transformers' own mask allows."""
    theirs = io.attention_mask[g.layer_type][0, 0, :n_tok]
    n_key = int(io.total_seqlen_k[g.layer_type])
    theirs = theirs[:, :n_key] == 0
    kp, kr = key_pos[:n_key][None, :], key_req[:n_key][None, :]
    ours = (tok_req[:, None] == kr) & (kp <= pos[:, None])
    if g.window is not None:
        ours &= kp > pos[:, None] - g.window
    if not torch.equal(ours, theirs):
        bad = (ours != theirs).nonzero()[0].tolist()
        raise MetadataError(f"the attention mask derived from cu_seq_lens differs from transformers' own mask for the "
                            f"{g.layer_type} layers at (query, key) {tuple(bad)}: stale cu_seq_lens")


# --------------------------------------------------------------------------- planning


def _covering(buckets: Sequence[int], n: int) -> Optional[int]:
    for b in buckets:
        if b >= n:
            return b
    return None


def dim_limits(dims: Sequence[str], max_graphs: Optional[Dict[str, int]] = None) -> Dict[str, int]:
    """Graphs per dim: ``max_graphs[dim]``, else (a keys dim) ``max_graphs["kv"]``, else
    :data:`DEFAULT_MAX_GRAPHS`'s."""
    given = dict(max_graphs or {})
    out = {}
    for d in dims:
        fallback = "kv" if d.startswith("kv") else d
        out[d] = int(given.get(d, given.get(fallback, DEFAULT_MAX_GRAPHS[fallback])))
    return out


def plan_keys(step_sizes: Sequence[Tuple[int, ...]], max_graphs: Optional[Dict[str, int]] = None,
              dims: Sequence[str] = _DIMS) -> Tuple[Dict[str, List[int]], List[Tuple[int, ...]]]:
    """``(buckets, keys)`` for ``step_sizes`` (a size per dim of ``dims`` per step; by default
    ``(tokens, kv, reqs)``).

    Each dim is planned on its own by :func:`graphrunner.plan_buckets` with at
    most :func:`dim_limits` buckets (default :data:`DEFAULT_MAX_GRAPHS`); the
    keys are the ones the steps land on, plus the key of the largest bucket of
    every dim (the static buffers are allocated at it). Raises ``ValueError``
    for an empty workload or a step of another length than ``dims``."""
    dims = tuple(dims)
    sizes = [tuple(int(v) for v in s) for s in step_sizes]
    if not sizes:
        raise ValueError("no step sizes to plan buckets from: pass buckets= or a non-empty workload")
    bad = [s for s in sizes if len(s) != len(dims)]
    if bad:
        raise ValueError(f"step size {bad[0]} does not give one size per dim {list(dims)}")
    buckets = plan_buckets({d: [s[i] for s in sizes] for i, d in enumerate(dims)},
                           max_graphs=dim_limits(dims, max_graphs), progress=False)
    keys = {tuple(_covering(buckets[d], s[i]) for i, d in enumerate(dims)) for s in sizes}
    keys.add(tuple(buckets[d][-1] for d in dims))
    return buckets, sorted(keys)


# --------------------------------------------------------------------------- the hook on transformers' manager


class GraphBatching:
    """The graph-served step of one transformers ``ContinuousBatchingManager``.

    ``GraphBatching(model, buckets=None, keys=None, max_graphs=None, backend="full", device="auto",
    debug=False, checks=("drift", "fingerprint"), equivalence=True, validate=True, background=False)``;
    :meth:`install` it on a manager
    (``model.init_continuous_batching(...)``) before the manager starts: the
    manager's batch processor then runs every varlen step's forward through
    :attr:`runner` (a :class:`~graphrunner.GraphRunner` over the dims :attr:`dims`:
    ``tokens``, a keys dim per attention type (``kv``, and ``kv_sliding`` for a
    model that mixes sliding and full layers: :func:`batch_dims`), ``reqs``) once
    :meth:`capture` has run, and eagerly before. Steps
    larger than every key take GraphRunner's eager fallback (counted in
    ``stats.eager_steps``). Everything but the forward (logits processors,
    sampling, scheduling) is transformers' own code.

    ``buckets``: ``{"tokens": [...], "kv": [...], "reqs": [...]}`` (``kv`` also
    stands for a keys dim not named itself), or ``None`` to plan them from the
    step sizes recorded so far (:meth:`plan`); ``keys``: tuples in the order of
    :attr:`dims`. ``max_graphs``: per dim, as :func:`dim_limits`.
    ``equivalence``: after capture, replay every key on a synthetic batch
    whose metadata is valid (random requests, positions and cache slots) and
    compare with the eager step on the same batch unpadded; a difference is a
    :class:`CaptureError`. GraphRunner's generic padding check draws every
    integer input independently, which breaks the request structure the mask is
    built from (a token and a key of one request), so it is replaced by this
    one by default (``checks=`` passes GraphRunner's checks through).
    ``validate``: check every step's metadata at the call (:func:`step_feeds`;
    ``False`` only to measure what the checks cost). ``debug=True`` also
    compares the mask built from the metadata with transformers' own mask at
    every step, and turns on GraphRunner's debug mode (bounds of every input).
    ``background=True``: :meth:`capture` starts GraphRunner's background capture
    and returns at once; steps are served eagerly (on inputs padded to their key,
    counted in ``eager_steps``) until their key is captured, then replayed. The
    equivalence check does not run then (it needs the whole capture).
    ``autocapture=True``: the background capture starts by itself when the
    manager creates its batch processor, over keys from
    :func:`graphrunner.hf.ladder.ladder_keys` (``buckets``/``keys`` when given),
    and every ``replan_every`` steps (0: never) the keys are re-planned from the
    recent step sizes (:func:`graphrunner.hf.ladder.replan`); the manager's
    cache-writing and sampling work never runs beside a key's capture.
    Raises :class:`CaptureError` at capture for a model :func:`refusal` refuses
    and for padding tokens that would write a real cache slot."""

    def __init__(self, model, buckets: Optional[Dict[str, Sequence[int]]] = None, keys: Optional[Sequence] = None,
                 max_graphs: Optional[Dict[str, int]] = None, backend: Any = "full", device: Any = "auto",
                 debug: bool = False, checks: Any = ("drift", "fingerprint"), equivalence: bool = True,
                 validate: bool = True, background: bool = False, autocapture: bool = False,
                 replan_every: int = 256) -> None:
        #: The step's dims: ``tokens``, one keys dim per attention type, ``reqs`` (:func:`batch_dims`).
        self.dims = batch_dims(model)
        names = set(self.dims) | {"kv"}
        if buckets is not None:
            missing = [d for d in self.dims if d not in buckets and not (d.startswith("kv") and "kv" in buckets)
                       ] if isinstance(buckets, dict) else list(self.dims)
            if not isinstance(buckets, dict) or set(buckets) - names or missing:
                raise ValueError(f"buckets must be a dict with the dims {list(self.dims)} (kv stands for a keys dim "
                                 f"not named), got {buckets!r}")
            buckets = {d: buckets[d] if d in buckets else buckets["kv"] for d in self.dims}
        if max_graphs is not None:
            unknown = set(max_graphs) - names
            if unknown:
                raise ValueError(f"max_graphs names unknown dims {sorted(unknown)}; the dims are {list(self.dims)}")
        if keys is not None and any(len(k) != len(self.dims) for k in keys):
            raise ValueError(f"keys must be tuples of one size per dim {list(self.dims)}, got {list(keys)!r}")
        if isinstance(replan_every, bool) or not isinstance(replan_every, int) or replan_every < 0:
            raise ValueError(f"replan_every must be a number of steps >= 0 (0: never re-plan), got {replan_every!r}")
        self.model = model
        self.buckets = None if buckets is None else {d: sorted(int(b) for b in buckets[d]) for d in self.dims}
        self.keys = None if keys is None else [tuple(int(v) for v in k) for k in keys]
        self.max_graphs = max_graphs
        self.backend, self.device, self.debug, self.checks = backend, device, bool(debug), checks
        self.equivalence, self.validate, self.background = bool(equivalence), bool(validate), bool(background)
        #: Capture in the background from the manager's first session on, keys from the ladder, re-planned.
        self.autocapture, self.replan_every = bool(autocapture), int(replan_every)
        self._window: "collections.deque[Tuple[int, ...]]" = collections.deque(maxlen=4 * max(self.replan_every, 256))
        self._since_plan = 0
        self._replan_due = False
        self._capture_began: Optional[float] = None
        #: A re-plan's runner while its keys are captured (the current one serves meanwhile).
        self._pending: Optional[GraphRunner] = None
        self._pending_began = 0.0
        self.mode = "eager"  # "record" (dry run: no forward), "eager", "graph"
        self.runner: Optional[GraphRunner] = None
        self.report = None
        self.stats = BatchingStats()
        self.batch_processor = None
        self.groups: List[_Group] = []
        self.record_token = 0
        self._original_compute = None
        self._eos: List[int] = []
        #: The first exception the step raised inside transformers' generation thread (re-raised by generate_batch).
        self.error: Optional[BaseException] = None

    # ----------------------------------------------------------------- installation
    def install(self, manager) -> None:
        """Hook this object into ``manager`` (a ``ContinuousBatchingManager``, not started): its batch processor,
        created in the generation thread, runs the forward through :meth:`compute_batch`. Raises
        :class:`CaptureError` when :func:`refusal` refuses the model."""
        why = refusal(self.model, manager.continuous_batching_config)
        if why is None and manager.continuous_batching_config.use_async_batching:
            why = "asynchronous batching double-buffers the step's inputs; run it with use_async_batching=False"
        if why is not None:
            raise CaptureError(f"gr.hf.generate_batch cannot serve architecture {self._model_type()!r}: {why}")
        eos = manager.generation_config.eos_token_id
        self._eos = [eos] if isinstance(eos, int) else list(eos or [])
        vocab = self._vocab()
        self.record_token = next(t for t in range(vocab) if t not in self._eos)
        original = manager._create_batch_processor

        def create():
            bp = original()
            if self.batch_processor is not bp:
                self._attach(bp)
            return bp

        manager._create_batch_processor = create
        destroy = manager.destroy

        def destroy_and_release() -> None:
            destroy()
            self.release()

        manager.destroy = destroy_and_release
        self.manager = manager

    def release(self) -> None:
        """Stop a background capture and release the graphs (``manager.destroy()`` calls it): a capture
        thread must not outlive its manager. The steps run eagerly again until :meth:`capture`."""
        runners, self.runner, self._pending = (self.runner, self._pending), None, None
        self.mode = "eager"
        for runner in runners:
            if runner is not None:
                runner.cleanup()

    def _attach(self, bp) -> None:
        self.batch_processor = bp
        mr = bp.model_runner
        if mr.pad_inputs:
            raise CaptureError("the manager pads its inputs for its own CUDA graphs or torch.compile: build it with "
                               "use_cuda_graph=False and no compile config (graphrunner captures the step)")
        self.groups = _groups(bp.cache)
        if tuple(g.dim for g in self.groups) != self.dims[1:-1]:
            raise CaptureError(f"the cache's attention types {[g.layer_type for g in self.groups]} do not match the "
                               f"model config's keys dims {list(self.dims[1:-1])}")
        if not self.debug and bp.inputs_and_outputs.attention_mask is not None:
            # the step builds its masks from the metadata: transformers' host-side [tokens, kv] mask fill
            # (prepare_batch_tensors) is skipped; debug mode keeps it to compare with
            bp.inputs_and_outputs.attention_mask = None
        self._original_compute = mr.compute_batch
        mr.compute_batch = self.compute_batch
        if self.autocapture:
            # transformers writes the cache outside the forward too (prefix-cache forks, offloading) and
            # samples from the default generator after it: a background key capture, which puts back
            # what it wrote when it ends, must not run beside any of that
            for name in ("prepare_next_batch", "_generation_step", "update_batch"):
                setattr(bp, name, self._guarded(getattr(bp, name)))
            self.capture()

    def _guarded(self, fn):
        """``fn`` run while no background key capture runs (``runner.hold()`` of the runner serving and
        of a re-plan's runner being captured); a re-plan found due by a step is started after it,
        outside the holds, and a re-plan's runner takes over once every key of it is captured."""
        def run(*args, **kwargs):
            with contextlib.ExitStack() as held:
                for runner in (self.runner, self._pending):
                    if runner is not None:
                        held.enter_context(runner.hold())
                out = fn(*args, **kwargs)
            if self._pending is not None:
                self._settle_replan()
            elif self._replan_due:
                self._replan_due = False
                self._replan()
            return out
        return run

    def _model_type(self) -> str:
        return getattr(getattr(self.model, "config", None), "model_type", type(self.model).__name__)

    def _max_position(self) -> int:
        """An upper bound on positions: the model's max_position_embeddings or what the cache can hold, the larger."""
        text = self.model.config.get_text_config()
        cache = self.batch_processor.cache
        return max(int(getattr(text, "max_position_embeddings", 0) or 0), int(cache.max_tokens_read) + 1)

    def _vocab(self) -> int:
        emb = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        return int(getattr(emb, "num_embeddings", None) or self.model.config.get_text_config().vocab_size)

    # ----------------------------------------------------------------- the substituted method
    def compute_batch(self, model, batch_data: dict) -> None:
        """``ModelRunner.compute_batch`` served by the graphs: forward (replayed), then transformers' own
        logits processing and sampling into the output tensor."""
        try:
            return self._compute_batch(model, batch_data)
        except BaseException as exc:  # transformers' loop turns it into failed requests: keep it to re-raise
            if self.error is None:
                self.error = exc
            raise

    def _compute_batch(self, model, batch_data: dict) -> None:
        bp = self.batch_processor
        io = bp.inputs_and_outputs
        mr = bp.model_runner
        if io.use_block_table:  # the decode fast path (flash attention only): never reached for masked attention
            self.stats.steps += 1
            self.stats.eager_steps += 1
            return self._original_compute(model, batch_data)
        feeds = step_feeds(io, bp.cache, self.groups, debug=self.debug, validate=self.validate)
        size = (int(io.total_seqlen_q), *(int(feeds[f"read_index_{g.index}"].shape[0]) for g in self.groups),
                int(io.num_request_in_batch))
        self.stats.step_sizes.append(size)
        if self.autocapture:
            self._window.append(size)
            if len(self.stats.step_sizes) > 2 * self._window.maxlen:  # a server runs for ever: keep the recent ones
                del self.stats.step_sizes[: -self._window.maxlen]
                del self.stats.engine_sizes[: -self._window.maxlen]
            self._since_plan += 1
            if self.replan_every and self._since_plan >= self.replan_every:
                self._since_plan = 0
                self._replan_due = True
        self.stats.engine_sizes.append((size[0], int(io.max_kv_read), tuple(int(v) for v in io.max_length_k.values())))
        if self.mode == "record":
            io.output_ids[0, : size[-1]].fill_(self.record_token)
            return None
        self.stats.steps += 1
        runner = self.runner
        if self.mode == "graph" and runner is not None:
            before = runner.stats.fallbacks
            logits = runner(**feeds)
            if runner.stats.fallbacks > before:
                self.stats.eager_steps += 1
            else:
                self.stats.replayed += 1
                key = runner.stats.last_bucket
                self.stats.real_tokens += size[0]
                self.stats.padded_tokens += int(key[0]) - size[0]
                self.stats.real_keys += sum(size[1:-1])
                self.stats.padded_keys += sum(int(k) for k in key[1:-1]) - sum(size[1:-1])
        else:
            self.stats.eager_steps += 1
            logits = self._step()(**feeds)
        self._sample(mr, batch_data, logits, io)
        return None

    def _sample(self, mr, batch_data: dict, logits: torch.Tensor, io) -> None:
        """transformers' ``_forward_process_and_sample`` after the forward, on the step's logits."""
        logits = logits.unsqueeze(0).float()  # [1, num_logits, vocab]
        if mr.logit_processor.do_processing:
            _, num_logits, vocab = logits.shape
            logits_2d = logits.view(num_logits, vocab)
            sliced = batch_data["input_ids"][0, batch_data["logits_indices"]]
            logits_2d = mr.logit_processor(sliced, logits_2d, batch_data["logits_processor_args"])
            scores = logits_2d.view(1, num_logits, vocab)
        else:
            scores = logits
        mr._sample(scores, io.output_ids)

    def _step(self):
        bp = self.batch_processor
        if getattr(self, "_step_fn", None) is None:
            self._step_fn = make_step(self.model, bp.cache, self.groups, bp.model_runner.supports_logits_to_keep(self.model),
                                      self._max_position(), int(bp.inputs_and_outputs.max_requests_per_batch))
        return self._step_fn

    # ----------------------------------------------------------------- planning and capture
    def plan(self) -> Tuple[Dict[str, List[int]], List[Tuple[int, ...]]]:
        """Buckets and keys: the declared ones, else :func:`plan_keys` over the step sizes recorded so far,
        else (``autocapture``, no step yet) the ladder up to the configured sizes
        (:func:`graphrunner.hf.ladder.ladder_keys`)."""
        if self.buckets is not None:
            if self.keys is not None:
                return self.buckets, self.keys
            import itertools
            return self.buckets, sorted(itertools.product(*(self.buckets[d] for d in self.dims)))
        if self.autocapture and not self.stats.step_sizes:
            return ladder_keys(self._maxima(), self.dims, self.max_graphs)
        return plan_keys(self.stats.step_sizes, self.max_graphs, self.dims)

    def _maxima(self) -> Dict[str, int]:
        """The largest size of each dim the configured cache and batch allow."""
        bp = self.batch_processor
        io, cache = bp.inputs_and_outputs, bp.cache
        tokens = int(cache.max_batch_tokens)
        out = {"tokens": tokens, "reqs": int(io.max_requests_per_batch)}
        for g in self.groups:
            out[g.dim] = int(cache.max_tokens_read) + tokens
        return out

    def _new_runner(self, buckets: Dict[str, List[int]], keys: Sequence[Tuple[int, ...]]) -> GraphRunner:
        bp = self.batch_processor
        spec = step_inputs(self.groups, self._vocab(), self._max_position(),
                           int(bp.inputs_and_outputs.max_requests_per_batch), int(bp.cache.max_batch_tokens))
        return GraphRunner(self._step(), inputs=spec, buckets=buckets, keys=keys, outputs=("reqs",),
                           backend=self.backend, device=self.device, progress=False, checks=self.checks,
                           debug=self.debug, fallback="eager")

    def _background(self, buckets: Dict[str, List[int]], keys: Sequence[Tuple[int, ...]]) -> None:
        """Serve through a new runner over ``keys`` at once, its keys captured on a thread."""
        runner = self._new_runner(buckets, keys)
        runner.capture(background=True)  # puts back what each key's capture writes: no cache reset
        self._capture_began = time.perf_counter()
        self._serve_through(runner)

    def _serve_through(self, runner: GraphRunner) -> None:
        """Every step goes through ``runner`` from now on; its keys in ``stats``."""
        self.runner, self.mode = runner, "graph"
        self.stats.graphs = len(runner.keys)
        self.stats.keys = [tuple(k) for k in runner.keys]

    def captured(self) -> int:
        """Keys that replay now (all of :attr:`runner`'s after a blocking capture; during a background
        one, those captured so far); adds a finished background capture's time to ``stats.capture_seconds``."""
        runner = self.runner
        if runner is None:
            return 0
        n = len(runner.captured_keys)
        if self._capture_began is not None and n == len(runner.keys):
            self.stats.capture_seconds += time.perf_counter() - self._capture_began
            self._capture_began = None
        return n

    def _replan(self) -> None:
        """``autocapture``: once the current keys are all captured, re-plan them from the recent step
        sizes (:func:`graphrunner.hf.ladder.replan`) and, when that cuts the padding, capture a runner
        over the new keys in the background while the current one serves on; it takes over when all
        its keys are captured (:meth:`_settle_replan`), so a re-plan never serves a step eagerly."""
        old = self.runner
        if old is None or self._pending is not None or self.captured() < len(old.keys) or self.buckets is not None:
            return
        plan = replan(list(self._window), [tuple(k) for k in old.keys], self.dims, self.max_graphs)
        if plan is None:
            return
        logger.info("gr.hf: re-planning the keys from %d recent steps: %d keys -> %d", len(self._window),
                    len(old.keys), len(plan[1]))
        self._pending = self._new_runner(*plan)
        self._pending.capture(background=True)
        self._pending_began = time.perf_counter()

    def wait_captured(self, timeout: Optional[float] = None) -> bool:
        """Wait up to ``timeout`` s (each) for the background capture of :attr:`runner`'s keys and of a
        re-plan's keys (which take over at the step after); True when both are done."""
        done = True
        for runner in (self.runner, self._pending):
            if runner is not None and runner.wait_captured(timeout) is None:
                done = False
        return done

    def _settle_replan(self) -> None:
        """The re-plan's runner serves from now on once all its keys are captured (the old one is
        released); a failed re-plan capture is dropped, the current keys serve on."""
        pending = self._pending
        if pending.capture_error is not None:
            logger.warning("gr.hf: the re-planned keys' capture failed, serving on with the current keys: %s",
                           pending.capture_error)
            self._pending = None
            pending.cleanup()
            return
        if pending.wait_captured(timeout=0) is None:
            return
        old, self._pending = self.runner, None
        self._serve_through(pending)
        self.stats.capture_seconds += time.perf_counter() - self._pending_began
        self.stats.replans += 1
        if old is not None:
            old.cleanup()

    def capture(self):
        """Build :attr:`runner` over the planned keys and capture it (blocking); return GraphRunner's report
        (``None`` with ``background=True``: the capture runs on a thread, ``runner.wait_captured()`` waits).

        Needs the batch processor (the manager has run once). Checks the trash
        slots first, runs the equivalence check after, and puts back the paged
        cache and the default generator's state as they were before (the
        capture's forwards write the cache; the prefix-cache blocks of earlier
        sessions stay valid for later ones). With ``background=True`` or
        ``autocapture=True`` the keys are captured on a thread while the steps
        are served (each key's capture puts back what it wrote). Raises
        :class:`CaptureError` naming the architecture and the reason."""
        bp = self.batch_processor
        if bp is None:
            raise GraphRunnerError("capture() needs the manager's batch processor: run the manager once first "
                                   "(gr.hf.generate_batch does a dry run of the scheduler)")
        try:
            check_trash(bp.cache, self.groups)
        except CaptureError as exc:
            raise CaptureError(f"gr.hf.generate_batch cannot serve architecture {self._model_type()!r}: {exc}") from exc
        buckets, keys = self.plan()
        if self.background or self.autocapture:
            self._background(buckets, keys)
            return None
        cache = bp.cache
        t0 = time.perf_counter()
        # the capture's forwards write the paged cache, whose blocks the prefix cache gives to later
        # sessions, and may draw from the default generator: both are put back as they were
        saved = cache.cache_tensor.to("cpu", copy=True)
        rng = torch.get_rng_state()
        try:
            self.runner = self._new_runner(buckets, keys)
            with torch.inference_mode():
                self.report = self.runner.capture()
                if self.equivalence:
                    self._equivalence()
        except GraphRunnerError as exc:
            if isinstance(exc, CaptureError) and "gr.hf.generate_batch" in str(exc):
                raise
            raise CaptureError(f"gr.hf.generate_batch cannot serve architecture {self._model_type()!r}: {exc}") from exc
        finally:
            cache.cache_tensor.copy_(saved)
            torch.set_rng_state(rng)
        self.stats.capture_seconds += time.perf_counter() - t0
        self._serve_through(self.runner)
        return self.report

    def _equivalence(self) -> None:
        """Every key: a synthetic valid batch replayed padded, then a follow-up step that reads what it wrote,
        against both run eagerly without padding."""
        runner = self.runner
        gen = torch.Generator().manual_seed(0x6B76)
        by_dim = {d: sorted({k[i] for k in runner.keys}) for i, d in enumerate(self.dims)}
        checked = 0
        # every comparison starts from the cache as it is now and puts it back: one copy serves them all
        saved = self.batch_processor.cache.cache_tensor.clone()
        for key in sorted(runner.keys, key=lambda k: tuple(k)):
            small = []
            for i, d in enumerate(self.dims):
                below = [b for b in by_dim[d] if b < key[i]]
                small.append(max(1, (below[-1] + 1) if below else 1))
            # the smallest sizes that replay the key (padded); when those land on another key, the key's own sizes
            for sizes in (small, list(key)):
                made = self._synthetic(key, sizes, gen)
                if made is None:
                    continue
                feeds, plan = made
                diff, scale, landed = self._compare_once(feeds, self._follow_up(plan, gen), saved)
                if landed != tuple(key):
                    continue
                checked += 1
                if not diff <= scale * 1e-4 + 1e-6:
                    raise CaptureError(
                        f"gr.hf.generate_batch cannot serve architecture {self._model_type()!r}: the replayed step "
                        f"of key {tuple(self.dims)}={tuple(key)}, or the step after it, differs from the eager steps on "
                        f"the same valid batches without padding (real sizes {tuple(sizes)}; max abs diff {diff:.3g} "
                        f"of scale {scale:.3g}): "
                        "padding tokens or keys reach real requests (a padding write into a real cache slot, a mask "
                        "that lets a real query see a padding key)")
                break
        self.stats.equivalence_checked = checked

    def _compare_once(self, feeds: Dict[str, torch.Tensor], follow: Dict[str, torch.Tensor],
                      saved: torch.Tensor) -> Tuple[float, float, Any]:
        """Two call sequences from the same cache, ``saved`` (what the cache holds now): ``feeds`` replayed
        (padded to their key) then ``follow`` run eagerly, against both run eagerly without padding; the
        cache put back to ``saved`` after each. ``(max abs diff over both calls, scale, key replayed)``: the
        second call sees what the padding tokens of the first wrote."""
        runner = self.runner
        real = {k: v.clone() for k, v in feeds.items()}
        cache = self.batch_processor.cache.cache_tensor
        try:
            got = [runner(**feeds).clone()]
            landed = runner.stats.last_bucket
            got.append(self._step()(**follow))
            cache.copy_(saved)
            want = [self._step()(**real), self._step()(**follow)]
        finally:
            cache.copy_(saved)
        diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(got, want))
        scale = max(b.double().abs().max().item() for b in want)
        return diff, scale, None if landed is None else tuple(landed)

    def _synthetic(self, key, sizes, gen: torch.Generator) -> Optional[Tuple[Dict[str, torch.Tensor], Dict[str, Any]]]:
        """A valid batch of ``sizes`` (one per dim of :attr:`dims`) for full/sliding layers: ``reqs`` requests
        whose queries end each prompt, each attention type reading its keys dim's count of the request's
        most recent keys, every real write a distinct real slot; with its plan (per request queries and
        past, per group the past read and the slots) for :meth:`_follow_up`. A write-trash slot that is
        a real slot (a planted bug) is given to a real new token: full layers read it back in this
        batch, sliding layers only in the follow-up."""
        n_tok, n_req = sizes[0], min(sizes[-1], sizes[0])
        kv = {g.index: max(n, n_tok) for g, n in zip(self.groups, sizes[1:-1])}
        if n_tok > key[0] or n_req > key[-1] or any(kv[g.index] > k for g, k in zip(self.groups, key[1:-1])):
            return None
        # split tokens and keys over requests: request r gets q_r >= 1 queries and a past of P_r positions
        cut_q = sorted(torch.randperm(n_tok - 1, generator=gen)[: n_req - 1].add(1).tolist()) if n_req > 1 else []
        lens_q = [b - a for a, b in zip([0] + cut_q, cut_q + [n_tok])]
        extra = max(kv.values()) - n_tok
        cut_e = sorted(torch.randint(0, extra + 1, (n_req - 1,), generator=gen).tolist()) if n_req > 1 else []
        past = [b - a for a, b in zip([0] + cut_e, cut_e + [extra])]
        pos, treq, logit_idx = [], [], []
        for r, (q, p) in enumerate(zip(lens_q, past)):
            pos.extend(range(p, p + q))
            treq.extend([r] * q)
            logit_idx.append(len(pos) - 1)
        ids = torch.randint(0, self._vocab(), (n_tok,), generator=gen)
        feeds = {"input_ids": ids.to(torch.int32), "position_ids": torch.tensor(pos, dtype=torch.int32),
                 "tok_req": torch.tensor(treq, dtype=torch.int32), "logits_indices": torch.tensor(logit_idx, dtype=torch.int32)}
        plan: Dict[str, Any] = {"lens_q": lens_q, "past": past, "read_past": {}, "slots": {}}
        for g in self.groups:
            # this type reads the most recent read_past[r] <= past[r] of each request's past positions
            read_past, deficit = list(past), extra - (kv[g.index] - n_tok)
            for r in torch.randperm(n_req, generator=gen).tolist():
                cut = min(read_past[r], deficit)
                read_past[r] -= cut
                deficit -= cut
            n_kv = kv[g.index]
            slots = torch.randperm(g.last_index - g.first_real + 1, generator=gen)[: n_kv + n_req] + g.first_real
            if g.first_real <= g.write_trash <= g.last_index:  # the padding write slot is a real one: meet it
                first_new = read_past[0]  # request 0's first new token
                slots[slots == g.write_trash] = slots[first_new].clone()
                slots[first_new] = g.write_trash
            plan["slots"][g.index], plan["read_past"][g.index] = slots, read_past
            read, write, kreq, kpos, at = [], [], [], [], 0
            for r, (q, p, rp) in enumerate(zip(lens_q, past, read_past)):
                s = slots[at: at + rp + q].tolist()
                at += rp + q
                # full layers: the new tokens' keys written then read back; sliding: sentinels for the new keys
                read.extend(s if g.window is None else s[:rp] + [g.sentinel] * q)
                write.extend(s[rp:])
                kreq.extend([r] * (rp + q))
                kpos.extend(range(p - rp, p + q))
            _put_group(feeds, g, write, read, kreq, kpos)
        dev = self.batch_processor.inputs_and_outputs.input_ids.device
        return {k: v.to(dev) for k, v in feeds.items()}, plan

    def _follow_up(self, plan: Dict[str, Any], gen: torch.Generator) -> Dict[str, torch.Tensor]:
        """The next step after a :meth:`_synthetic` batch: one new token per request, reading every key the
        request wrote or read before (so a real slot a padding token overwrote in that batch is read here)."""
        lens_q, past = plan["lens_q"], plan["past"]
        n_req = len(lens_q)
        dev = self.batch_processor.inputs_and_outputs.input_ids.device
        pos = [p + q for q, p in zip(lens_q, past)]
        feeds = {"input_ids": torch.randint(0, self._vocab(), (n_req,), generator=gen).to(torch.int32),
                 "position_ids": torch.tensor(pos, dtype=torch.int32),
                 "tok_req": torch.arange(n_req, dtype=torch.int32),
                 "logits_indices": torch.arange(n_req, dtype=torch.int32)}
        for g in self.groups:
            slots, read_past = plan["slots"][g.index], plan["read_past"][g.index]
            n_kv = sum(read_past) + sum(lens_q)
            read, write, kreq, kpos, at = [], [], [], [], 0
            for r, (n, rp, q) in enumerate(zip(pos, read_past, lens_q)):
                old, new = slots[at: at + rp + q].tolist(), int(slots[n_kv + r])
                at += rp + q
                read.extend(old + ([new] if g.window is None else [g.sentinel]))
                write.append(new)
                kreq.extend([r] * (rp + q + 1))
                kpos.extend(range(n - rp - q, n + 1))
            _put_group(feeds, g, write, read, kreq, kpos)
        return {k: v.to(dev) for k, v in feeds.items()}


def _put_group(feeds: Dict[str, torch.Tensor], g: _Group, write, read, key_req, key_pos) -> None:
    """Write allocator ``g``'s four per-key and per-token inputs (Python lists) into ``feeds``."""
    feeds[f"write_index_{g.index}"] = torch.tensor(write, dtype=torch.int64)
    feeds[f"read_index_{g.index}"] = torch.tensor(read, dtype=torch.int64)
    feeds[f"key_req_{g.index}"] = torch.tensor(key_req, dtype=torch.int32)
    feeds[f"key_pos_{g.index}"] = torch.tensor(key_pos, dtype=torch.int32)


# --------------------------------------------------------------------------- a manager


def init_continuous_batching(model, generation_config=None, continuous_batching_config=None, workload_hints=None,
                             **options: Any):
    """``model.init_continuous_batching(...)`` with a :class:`GraphBatching` installed: returns the manager,
    its hook as ``manager.graphs``.

    Use the manager as transformers documents it (``start()``, ``add_request(...)``,
    ``get_result()``, ``stop(keep_for_next_session=True)`` between sessions,
    ``destroy()``). Its steps run eagerly through the graph step (recording
    their sizes) until ``manager.graphs.capture()`` is called between two
    sessions (the manager stopped, its batch processor created by a first
    session): the keys are then planned from the sizes recorded (or from
    ``buckets``/``keys``), and every later session replays them. The cache keeps its
    tensors (and its prefix-cache blocks) across sessions: the capture puts
    back what it wrote, so every session before and after it generates what
    transformers' own manager does.

    ``autocapture=True`` is the form a server takes (it never stops its
    manager): from the first session on, the keys are planned from a ladder up
    to the configured cache and batch sizes and captured in the background
    while the steps are served (eagerly, padded, until their key is captured),
    then re-planned every ``replan_every`` steps from the sizes served when that
    cuts the padding (``stats.replans``). Options (keyword only) as
    :class:`GraphBatching`; ``TypeError`` for an unknown one. Raises
    :class:`CaptureError` for a model :func:`refusal` refuses."""
    why = refusal(model, continuous_batching_config)
    if why is not None:
        raise CaptureError(f"gr.hf.init_continuous_batching cannot serve architecture "
                           f"{getattr(getattr(model, 'config', None), 'model_type', type(model).__name__)!r}: {why}")
    manager = model.init_continuous_batching(generation_config=generation_config,
                                             continuous_batching_config=continuous_batching_config,
                                             workload_hints=workload_hints)
    try:
        hook = GraphBatching(model, **options)
        hook.install(manager)
    except BaseException:
        manager.destroy()
        raise
    manager.graphs = hook
    return manager


# --------------------------------------------------------------------------- generate_batch


def _workload_hints(inputs, generation_config, max_new_tokens):
    from transformers.generation.continuous_batching.utils import WorkloadHints

    n_ret = generation_config.num_return_sequences if generation_config.num_return_sequences is not None else 1
    return WorkloadHints(max_prompt_length=max(len(x) for x in inputs),
                         max_generated_length=max_new_tokens if max_new_tokens is not None else 0,
                         num_requests=len(inputs) * n_ret)


def generate_batch(model, inputs: List[List[int]], generation_config=None, continuous_batching_config=None, *,
                   buckets: Optional[Dict[str, Sequence[int]]] = None, keys: Optional[Sequence] = None,
                   max_graphs: Optional[Dict[str, int]] = None, backend: Any = "full", device: Any = "auto",
                   debug: bool = False, checks: Any = ("drift", "fingerprint"), equivalence: bool = True,
                   validate: bool = True, background: bool = False, stats: Optional[Dict[str, Any]] = None,
                   reuse: bool = True, **kwargs) -> Dict[str, Any]:
    """``model.generate_batch(inputs, generation_config, continuous_batching_config, **kwargs)`` with the varlen
    steps' forward replayed from graphrunner graphs; returns exactly what it returns.

    ``inputs``: a list of prompts (lists of token ids); ``generation_config``,
    ``continuous_batching_config`` and ``**kwargs`` (``max_new_tokens``,
    ``record_timestamps``, ``progress_bar``) as for ``model.generate_batch``.
    The result maps each request id (``req_0``, ...) to transformers'
    ``GenerationOutput`` (``generated_tokens``). Greedy outputs equal
    ``model.generate_batch`` token for token; sampled ones too with a
    ``continuous_batching_config.seed`` (or after the same ``torch.manual_seed``).

    How: a manager is built as ``model.generate_batch`` builds it (the same
    workload hints). Unless ``buckets=`` is given, a dry run of transformers'
    own scheduler over ``inputs`` (no forward; a fixed non-EOS token sampled)
    records the step sizes (``(tokens, kv, reqs)``; a keys dim per attention type), and ``gr.plan_buckets`` plans
    at most ``max_graphs[dim]`` buckets per dim (default
    :data:`DEFAULT_MAX_GRAPHS`); the keys captured are those the steps land
    on. Then the step is captured (``backend``, ``device``: as
    :class:`~graphrunner.GraphRunner`), checked (:class:`GraphBatching`), the cache
    emptied and the generation run. Steps larger than every key run
    eagerly. ``reuse=True`` (the default) keeps the manager and its graphs on
    the model: a later call with the same settings (generation and batching
    configs, the workload hints of its prompts, these options) captures
    nothing and starts from an empty cache, as a new manager does; another
    setting replaces them. :func:`release` frees them (or ``reuse=False``). ``debug``, ``checks``, ``equivalence``, ``validate``, ``background``
    (serve from the first step while the keys are captured on a thread): as
    :class:`GraphBatching`. ``stats``: a dict that receives :class:`BatchingStats` (``"stats"``),
    the capture report (``"report"``) and the runner (``"runner"``; released already with ``reuse=False``).

    Raises :class:`CaptureError` naming the architecture and the reason when the
    model cannot be served (see :func:`refusal`), ``ValueError``/``TypeError``
    for bad arguments."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if not isinstance(inputs, (list, tuple)) or not all(isinstance(x, (list, tuple)) for x in inputs):
        raise TypeError("inputs must be a list of prompts, each a list of token ids (as model.generate_batch takes)")
    if not inputs:
        return {}
    if any(len(x) == 0 for x in inputs):
        raise ValueError("every prompt in inputs needs at least one token")
    if stats is not None and not isinstance(stats, dict):
        raise TypeError(f"stats must be a dict to fill, got {type(stats).__name__}")
    why = refusal(model, continuous_batching_config)
    if why is not None:
        raise CaptureError(f"gr.hf.generate_batch cannot serve architecture "
                           f"{getattr(getattr(model, 'config', None), 'model_type', type(model).__name__)!r}: {why}")
    gen_cfg = model.generation_config if generation_config is None else generation_config
    if not isinstance(gen_cfg, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers GenerationConfig, got {type(gen_cfg).__name__}")
    # transformers fills the batching config in when it sizes the cache: it gets a copy, the user's stays as given
    cb_cfg = ContinuousBatchingConfig() if continuous_batching_config is None else copy.deepcopy(
        continuous_batching_config)
    max_new_tokens = kwargs.get("max_new_tokens", None)
    max_new_tokens = gen_cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
    if getattr(model, "_cached_continuous_batching_manager", None) is not None:
        raise GraphRunnerError("the model holds a persistent continuous batching manager; call "
                               "model.destroy_cached_continuous_batching_manager() first")
    hints = _workload_hints(inputs, gen_cfg, max_new_tokens)
    options = dict(buckets=buckets, keys=keys, max_graphs=max_graphs, backend=backend, device=device, debug=debug,
                   checks=checks, equivalence=equivalence, validate=validate, background=background)
    settings = repr((sorted(gen_cfg.to_dict().items()), sorted(vars(cb_cfg).items()), vars(hints),
                     sorted(options.items())))
    held = getattr(model, _HELD, None)
    if held is not None and (held.settings != settings or not reuse):
        release(model)
        held = None
    run_kwargs = {**kwargs, "persistent_manager": True}
    if held is None:
        manager = model.init_continuous_batching(generation_config=generation_config,
                                                 continuous_batching_config=cb_cfg, workload_hints=hints)
        hook = GraphBatching(model, **options)
    else:
        manager, hook = held.manager, held.hook
    ok = False
    try:
        model._cached_continuous_batching_manager = manager
        if held is None:
            hook.install(manager)
            t0 = time.perf_counter()
            hook.mode = "record"
            _quiet_generate(model, inputs, generation_config, cb_cfg, {**run_kwargs, "progress_bar": False})
            _reraise(hook)
            hook.stats.dry_run_seconds = time.perf_counter() - t0
            if hook.batch_processor is None:
                raise GraphRunnerError("the dry run did not start transformers' batch processor")
            hook.mode = "eager"
        hook.batch_processor.cache.reset()  # empty, as a new manager's: the dry run's blocks hold no real K/V
        if held is None:
            hook.capture()
        bp = hook.batch_processor
        bp.distributed_helper.set_tp_seed(cb_cfg.seed, bp.cache.device)  # as transformers seeds a new processor
        manager._request_counter = 0  # the same request ids as model.generate_batch
        model._cached_continuous_batching_manager = manager
        out = _quiet_generate(model, inputs, generation_config, cb_cfg, run_kwargs)
        _reraise(hook)
        ok = True
    finally:
        if getattr(model, "_cached_continuous_batching_manager", None) is manager:
            del model._cached_continuous_batching_manager  # model.generate_batch must not pick our manager up
        if hook.runner is not None and hook.background:
            hook.runner.wait_captured()
        runner = hook.runner  # for stats: destroying the manager releases it
        if ok and reuse:
            setattr(model, _HELD, _Held(settings, manager, hook))
        else:
            if getattr(model, _HELD, None) is not None and getattr(model, _HELD).manager is manager:
                delattr(model, _HELD)
            manager.destroy()  # releases the graphs too
    if stats is not None:
        stats.update({"stats": hook.stats, "report": hook.report, "runner": runner, "hook": hook})
    return out


#: The attribute of a model that holds what :func:`generate_batch` keeps for its next call.
_HELD = "_graphrunner_generate_batch"


@dataclass
class _Held:
    """A manager and its graphs kept on a model for the next :func:`generate_batch` call of ``settings``."""

    settings: str
    manager: Any
    hook: GraphBatching


def release(model) -> bool:
    """Free the manager, cache and graphs :func:`generate_batch` keeps on ``model`` for its next call (a
    background capture is stopped first). Returns True when there were some."""
    held = getattr(model, _HELD, None)
    if held is None:
        return False
    delattr(model, _HELD)
    held.manager.destroy()  # GraphBatching.install makes it release the graphs
    return True


def _reraise(hook: GraphBatching) -> None:
    """Raise the step's first exception (transformers' generation thread only logs it and fails the requests)."""
    if hook.error is not None:
        err, hook.error = hook.error, None
        raise err


def _quiet_generate(model, inputs, generation_config, cb_cfg, run_kwargs) -> Dict[str, Any]:
    """``model.generate_batch`` with transformers' warning about ``persistent_manager=True`` silenced:
    graphrunner passes it, not the user."""
    from transformers.generation.continuous_batching.utils import logger as cb_logger

    level = cb_logger.level
    cb_logger.setLevel(logging.ERROR)
    try:
        return model.generate_batch(inputs=inputs, generation_config=generation_config,
                                    continuous_batching_config=cb_cfg, **run_kwargs)
    finally:
        cb_logger.setLevel(level)
