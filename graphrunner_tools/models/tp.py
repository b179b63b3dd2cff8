"""Tensor-parallel split of the demo decoder: MLP and attention output, one ``all_reduce`` each.

:func:`shard_tensor_parallel` turns a :class:`~graphrunner_tools.models.llama.LlamaForCausalLM`
that every rank built from the same seed into this rank's shard, in place:

* ``mlp.gate_proj`` / ``mlp.up_proj`` keep this rank's slice of the intermediate features
  (column parallel) and ``mlp.down_proj`` the matching input columns (row parallel), followed
  by an ``all_reduce`` (sum) of its output;
* ``self_attn.o_proj`` keeps this rank's slice of its input features (row parallel over the
  heads' concatenated outputs), followed by an ``all_reduce`` (sum).

Embeddings, q/k/v projections, norms, the KV cache and ``lm_head`` stay replicated, so every rank
holds the full logits. The ``all_reduce`` is plain ``torch.distributed.all_reduce`` inside the
forward: a graph capture of the decode step records it and re-issues it at every replay. The
sum of the shards equals the unsplit layer up to float rounding (a sum of partial products).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RowParallelLinear", "shard_tensor_parallel"]


def _split(n: int, rank: int, world: int, what: str) -> slice:
    if n % world:
        raise ValueError(
            f"{what} ({n}) must be divisible by the tensor-parallel size {world}; "
            "pick a world size that divides it or another model width"
        )
    per = n // world
    return slice(rank * per, (rank + 1) * per)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x[..., cols] @ weight_shard.T)``: a linear layer split over its input features.

    ``weight`` is this rank's ``[out, in / world]`` shard, ``cols`` the slice of the input
    features it multiplies. With ``world == 1`` there is no collective. ``process_group`` is
    passed to ``torch.distributed.all_reduce`` (``None``: the default group).
    """

    def __init__(self, full: nn.Linear, rank: int, world: int, process_group: Any = None) -> None:
        super().__init__()
        self.cols = _split(full.in_features, rank, world, "in_features")
        self.weight = nn.Parameter(full.weight[:, self.cols].clone(), requires_grad=False)
        self.world = world
        self.process_group = process_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product, summed over the ranks (``x`` holds all input features)."""
        y = F.linear(x[..., self.cols], self.weight)
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(y, group=self.process_group)
        return y


class ShardedMLP(nn.Module):
    """SwiGLU MLP over this rank's slice of the intermediate features, output summed over ranks."""

    def __init__(self, mlp: nn.Module, rank: int, world: int, process_group: Any) -> None:
        super().__init__()
        rows = _split(mlp.gate_proj.out_features, rank, world, "intermediate_size")
        self.gate = nn.Parameter(mlp.gate_proj.weight[rows].clone(), requires_grad=False)
        self.up = nn.Parameter(mlp.up_proj.weight[rows].clone(), requires_grad=False)
        self.down = nn.Parameter(mlp.down_proj.weight[:, rows].clone(), requires_grad=False)
        self.world = world
        self.process_group = process_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(F.silu(F.linear(x, self.gate)) * F.linear(x, self.up), self.down)
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(y, group=self.process_group)
        return y


def shard_tensor_parallel(
    model: nn.Module, rank: int, world_size: int, process_group: Any | None = None, attention: bool = True
) -> nn.Module:
    """Replace, in place, each layer's MLP and ``o_proj`` of ``model`` by this rank's shard; return ``model``.

    ``attention=False`` splits only the MLP (``o_proj`` stays whole, one ``all_reduce`` per
    layer, and only ``intermediate_size`` must be divisible by ``world_size``).

    Every rank must call it on a model built from the same seed (same weights) and then run
    the same steps: each sharded layer makes one ``all_reduce`` per forward, so ranks must
    issue their forwards in the same order with the same shapes (a
    :class:`~graphrunner.GraphRunner` with ``group=`` agrees the bucket for that).
    ``world_size == 1`` leaves the weights whole and makes no collective.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``, or ``intermediate_size`` or
            ``num_heads * head_dim`` not divisible by ``world_size``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    with torch.inference_mode(False), torch.no_grad():
        for layer in model.model.layers:
            layer.mlp = ShardedMLP(layer.mlp, rank, world_size, process_group)
            if attention:
                attn = layer.self_attn
                attn.o_proj = RowParallelLinear(attn.o_proj, rank, world_size, process_group)
    return model
