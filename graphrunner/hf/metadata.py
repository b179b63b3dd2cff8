"""The contract of a step's metadata: what transformers' scheduler prepared, checked before a graph replays it.

:func:`step_feeds` turns a batch's ``ContinuousBatchingIOs`` into the step's
inputs (:func:`graphrunner.hf.batch_step.step_inputs`), deriving each token's
and key's request and position from ``cu_seq_lens`` and raising
:class:`MetadataError` where the metadata breaks the contract;
:func:`check_trash` checks, once at capture, that padding tokens write a slot no
request owns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from graphrunner.errors import CaptureError, GraphRunnerError
from graphrunner.hf.batch_step import CacheGroup

if TYPE_CHECKING:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

__all__ = ["MetadataError", "check_trash", "step_feeds"]


class MetadataError(GraphRunnerError, ValueError):
    """A step's metadata breaks the contract of :func:`generate_batch` (a stale or inconsistent
    ``cu_seq_lens``, a write index outside the cache, ...): raised at the call, before anything is replayed."""


def check_trash(cache: PagedAttentionCache, groups: Sequence[CacheGroup]) -> None:
    """Raise :class:`CaptureError` unless every allocator's write-trash slot (the write index of every
    padding token) lies in the trash sectors that no request is ever given."""
    for g in groups:
        if not (g.write_sector <= g.write_trash < g.first_real):
            raise CaptureError(
                f"padding tokens of the {g.layer_type} layers would write cache slot {g.write_trash}, which is not "
                f"in the write-trash sector (slots {g.write_sector}..{g.first_real - 1}; real slots start at "
                f"{g.first_real}): a padding token would overwrite a real request's K/V. The allocator's "
                "write_trash_index must point into the write-trash sector"
            )


def step_feeds(
    io: ContinuousBatchingIOs,
    cache: PagedAttentionCache,
    groups: Sequence[CacheGroup],
    debug: bool = False,
    validate: bool = True,
) -> dict[str, torch.Tensor]:
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
    q = _queries(io, validate)
    feeds: dict[str, torch.Tensor] = {
        "input_ids": q.input_ids,
        "position_ids": q.position_ids,
        "tok_req": q.tok_req,
        "logits_indices": io.logits_indices[: q.n_req],
    }
    for g in groups:
        write, read, key_req, key_pos = _group_feeds(io, cache, g, q, validate)
        feeds[f"write_index_{g.index}"] = write  # each attention type's keys: its own dim, its own length
        feeds[f"read_index_{g.index}"] = read
        feeds[f"key_req_{g.index}"] = key_req
        feeds[f"key_pos_{g.index}"] = key_pos
        if debug and io.attention_mask is not None:
            _compare_mask(io, g, q.tok_req, q.position_ids, key_req, key_pos, q.n_tok)
    return feeds


@dataclass
class _Queries:
    """A step's query tokens as :func:`step_feeds` derives them from ``cu_seq_lens_q``."""

    n_req: int
    n_tok: int
    lens_q: list[int]  # query tokens per request
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    req_ids: torch.Tensor  # 0..n_req-1
    tok_req: torch.Tensor  # each query token's request
    first_q: torch.Tensor  # each request's first query position


def _queries(io: ContinuousBatchingIOs, validate: bool) -> _Queries:
    """The step's query tokens, their requests and positions; ``cu_seq_lens_q``, the positions and
    ``logits_indices`` checked (``validate``)."""
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
        raise MetadataError(
            f"cu_seq_lens_q {cq} is stale or inconsistent: it must start at 0, grow by at "
            f"least 1 per request ({n_req} requests) and end at the step's {n_tok} query tokens"
        )
    position_ids = io.position_ids[:n_tok]
    req_ids = torch.arange(n_req, dtype=torch.int32, device=dev)
    tok_req = torch.repeat_interleave(req_ids, torch.tensor(lq, device=dev), output_size=n_tok)
    starts = cu_q[:-1].long()
    first_q = position_ids[starts]  # each request's first query position
    if validate and not torch.equal(position_ids.long(), (first_q - starts)[tok_req] + torch.arange(n_tok, device=dev)):
        raise MetadataError(
            "cu_seq_lens_q is stale or inconsistent with position_ids: positions are not consecutive "
            f"inside a request (cu_seq_lens_q {cq})"
        )
    expected = [cq[i + 1] - 1 for i, fs in enumerate(io.requests_in_batch) if fs.has_new_token]
    if validate and io.logits_indices[: len(expected)].tolist() != expected:
        raise MetadataError(
            f"logits_indices {io.logits_indices[:n_req].tolist()} do not point at the last token of "
            f"each sampled request (expected {expected} from cu_seq_lens_q)"
        )
    return _Queries(
        n_req=n_req,
        n_tok=n_tok,
        lens_q=lq,
        input_ids=io.input_ids[:n_tok],
        position_ids=position_ids,
        req_ids=req_ids,
        tok_req=tok_req,
        first_q=first_q,
    )


def _group_feeds(
    io: ContinuousBatchingIOs, cache: PagedAttentionCache, g: CacheGroup, q: _Queries, validate: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(write_index, read_index, key_req, key_pos)`` of allocator ``g``'s layers, checked (``validate``)."""
    n_req, n_tok, lq, dev = q.n_req, q.n_tok, q.lens_q, q.input_ids.device
    cu_k = io.cumulative_seqlens_k[g.layer_type][: n_req + 1]
    ck = cu_k.tolist()
    lk = [b - a for a, b in zip(ck, ck[1:])]
    n_key = ck[-1]
    if validate and (ck[0] != 0 or any(k < n for k, n in zip(lk, lq)) or n_key != int(io.total_seqlen_k[g.layer_type])):
        raise MetadataError(
            f"cu_seq_lens_k[{g.layer_type!r}] {ck} is stale or inconsistent: it must "
            "start at 0, give each request at least its query tokens and end at the keys read "
            f"({io.total_seqlen_k[g.layer_type]})"
        )
    write = io.write_index_storage[g.index, :n_tok]
    if validate and int(io.true_write_sizes[g.index]) != n_tok:
        raise MetadataError(f"write_index[{g.index}] has {io.true_write_sizes[g.index]} entries for {n_tok} tokens")
    read = _read_index(io, cache, g, q, n_key, validate)
    key_req = torch.repeat_interleave(q.req_ids, torch.tensor(lk, device=dev), output_size=n_key)
    # key j of request r sits at position first_q[r] - (lk[r] - lq[r]) + (j - ck[r]): j minus an offset per request
    first_q = q.first_q
    offset = cu_k[:-1] - first_q + torch.tensor([k - n for k, n in zip(lk, lq)], dtype=first_q.dtype, device=dev)
    key_pos = torch.arange(n_key, dtype=torch.int32, device=dev) - offset.to(torch.int32)[key_req]
    if validate:
        # full layers: every real token's K/V is kept; sliding layers: tokens beyond the window go to the write trash
        lo = g.write_sector if g.window is not None else g.first_real
        w_lo, w_hi = (int(v) for v in torch.aminmax(write))
        if w_lo < lo or w_hi > g.last_index:
            raise MetadataError(
                f"write_index[{g.index}] ({g.layer_type}) holds {write.tolist()}: a real token must "
                f"write a slot in {lo}..{g.last_index}, never a trash slot (sliding layers: the "
                "write trash only) or outside the cache"
            )
    return write, read, key_req, key_pos


def _read_index(
    io: ContinuousBatchingIOs, cache: PagedAttentionCache, g: CacheGroup, q: _Queries, n_key: int, validate: bool
) -> torch.Tensor:
    """The slots allocator ``g``'s layers read: transformers' ``read_index``, or, in a step that reads no
    past (all first prefill chunks), the step's own keys as the allocator indexes them."""
    if int(io.max_kv_read) > 0:
        if validate and int(io.true_read_sizes[g.index]) != n_key:
            raise MetadataError(
                f"read_index[{g.index}] has {io.true_read_sizes[g.index]} entries, cu_seq_lens_k "
                f"[{g.layer_type!r}] says {n_key}"
            )
        return io.read_index_storage[g.index, :n_key]
    # no request reads its past: read the step's own keys back, as the allocator would index them (full
    # layers: the written slots; sliding layers: sentinels)
    if validate and any(q.first_q.tolist()):
        raise MetadataError(
            "a step without cache reads (max_kv_read 0) holds a request that does not start at position 0"
        )
    alloc = cache.cache_allocators[g.layer_type]
    idx: list[int] = []
    for fs in io.requests_in_batch:
        idx.extend(alloc.get_read_indices(fs.state.request_id, 0, fs.query_length))
    read = torch.tensor(idx, dtype=torch.int64, device=q.input_ids.device)
    if validate and read.shape[0] != n_key:
        raise MetadataError(f"{read.shape[0]} keys rebuilt for the {g.layer_type} layers, cu_seq_lens_k says {n_key}")
    return read


def _compare_mask(
    io: ContinuousBatchingIOs,
    g: CacheGroup,
    tok_req: torch.Tensor,
    pos: torch.Tensor,
    key_req: torch.Tensor,
    key_pos: torch.Tensor,
    n_tok: int,
) -> None:
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
        raise MetadataError(
            f"the attention mask derived from cu_seq_lens differs from transformers' own mask for the "
            f"{g.layer_type} layers at (query, key) {tuple(bad)}: stale cu_seq_lens"
        )
