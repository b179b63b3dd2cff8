"""The keys of continuous batching's graphs planned from a workload's step sizes (after a dry run).

:func:`plan_keys` plans each dim's buckets by :func:`graphrunner.plan_buckets`
and keeps the keys the steps land on; :mod:`graphrunner.hf.ladder`, its
neighbour, starts a server's keys without a workload and re-plans them
through :func:`plan_keys`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from graphrunner.hf.batch_step import DIMS, for_dim
from graphrunner.planning import plan_buckets

__all__ = ["DEFAULT_MAX_GRAPHS", "dim_limits", "plan_keys"]

#: Default graphs per dim for :func:`gr.plan_buckets <graphrunner.plan_buckets>` over the dry run's step sizes
#: (the ``kv`` limit holds for every attention type's keys dim).
DEFAULT_MAX_GRAPHS = {"tokens": 8, "kv": 8, "reqs": 4}


def _covering(buckets: Sequence[int], n: int) -> int:
    """The smallest of ``buckets`` (increasing) that holds ``n``."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"no bucket of {list(buckets)} holds {n}")


def dim_limits(
    dims: Sequence[str], max_graphs: Mapping[str, int] | None = None, defaults: Mapping[str, int] = DEFAULT_MAX_GRAPHS
) -> dict[str, int]:
    """Graphs per dim: ``max_graphs[dim]``, else ``defaults[dim]`` (:data:`DEFAULT_MAX_GRAPHS`), a keys dim
    not named taking ``kv``'s (:func:`~graphrunner.hf.batch_step.for_dim`)."""
    given = dict(max_graphs or {})
    return {d: int(for_dim(given, d, for_dim(defaults, d))) for d in dims}


def plan_keys(
    step_sizes: Sequence[tuple[int, ...]], max_graphs: dict[str, int] | None = None, dims: Sequence[str] = DIMS
) -> tuple[dict[str, list[int]], list[tuple[int, ...]]]:
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
    buckets = plan_buckets(
        {d: [s[i] for s in sizes] for i, d in enumerate(dims)}, max_graphs=dim_limits(dims, max_graphs), progress=False
    )
    if not isinstance(buckets, dict):  # plan_buckets returns a dict for a dict of sizes
        raise TypeError(f"plan_buckets returned {type(buckets).__name__} for sizes per dim")
    keys = {tuple(_covering(buckets[d], s[i]) for i, d in enumerate(dims)) for s in sizes}
    keys.add(tuple(buckets[d][-1] for d in dims))
    return buckets, sorted(keys)
