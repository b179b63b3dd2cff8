"""The options of continuous batching on graphs, in one place: :class:`BatchingOptions`.

:func:`graphrunner.hf.generate_batch` and :func:`graphrunner.hf.init_continuous_batching`
take them as keywords (or as ``options=``) and hand one :class:`BatchingOptions`
to :class:`graphrunner.hf.batching.GraphBatching`. What depends on the model
(the names of the keys dims in ``buckets``, ``keys`` and ``max_graphs``) is
checked by :class:`~graphrunner.hf.batching.GraphBatching`, which knows them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from graphrunner.hf.batch_step import ATTENTION_FORMS
from graphrunner.hf.ladder import REPLAN_SHARE

__all__ = ["BatchingOptions"]


@dataclass(frozen=True, kw_only=True)
class BatchingOptions:
    """How a :class:`~graphrunner.hf.batching.GraphBatching` plans, captures, checks and serves its graphs.

    ``buckets``: ``{"tokens": [...], "kv": [...], "reqs": [...]}`` (``kv`` also
    stands for a keys dim not named itself), or ``None`` to plan them from the
    step sizes recorded (a dry run, or the sessions before ``capture()``);
    ``keys``: tuples in the order of the dims (default: every combination of
    ``buckets``). ``max_graphs``: graphs per dim for the planner (default
    :data:`graphrunner.hf.planning.DEFAULT_MAX_GRAPHS`; ``kv`` for every keys dim
    not named). ``backend``, ``device``, ``checks``: as
    :class:`~graphrunner.GraphRunner` (GraphRunner's generic padding check is
    replaced by ``equivalence``). ``debug``: compare the mask built from the
    metadata with transformers' own at every step, and GraphRunner's debug mode.
    ``equivalence``: after a blocking capture, replay every key on a synthetic
    valid batch and its follow-up step and compare with the eager steps unpadded
    (:class:`graphrunner.hf.equivalence.EquivalenceCheck`). ``validate``: check
    every step's metadata at the call (:func:`graphrunner.hf.metadata.step_feeds`;
    ``False`` only to measure what the checks cost). ``background``: capture on
    a thread while the steps are served (eagerly, padded, until their key is
    captured; no equivalence check). ``autocapture`` (a manager that is never
    stopped, a server): capture in the background from the first session on,
    the keys from a ladder (:func:`graphrunner.hf.ladder.ladder_keys`), re-planned
    every ``replan_every`` steps (0: never) from the recent step sizes, and no
    sooner than ``replan_share`` allows: a re-plan's capture (and the ladder's)
    takes at most that share of the serving time
    (:func:`graphrunner.pacing.rest_after`; 1: no rest). ``capture_share``: within one background capture
    (the ladder's, a re-plan's), the keys' share of the time while steps come: after a key that took
    ``d`` s the capture rests ``d * (1 - share) / share`` s unless no step came for 50 ms
    (:class:`graphrunner.pacing.Pace`; 1: keys back to back, a waiting step first).
    ``attention``: the step's attention form (:data:`graphrunner.hf.batch_step.ATTENTION_FORMS`):
    ``per_request`` (each request's queries against its own keys, a host-reading op the CPU tape replays),
    ``dense`` (the ``[tokens, kv]`` masks CUDA graphs replay, on any device), ``auto`` (per request on the
    tape, dense on CUDA graphs).
    ``group``: the ranks' group (:class:`graphrunner.TorchDistGroup` of a tensor-parallel model's ranks; ``None``: one
    rank) every runner of the manager agrees over: each step's one agreement collective decides the key on every
    rank, and a background capture's keys are granted at a step (or at an idle iteration of the loop, in a call
    without rows) and captured on every rank before the next one (every rank must run the same steps:
    transformers' TP manager does). A re-plan is decided at the same step on every rank (whether any rank's
    rest still runs is agreed) and its keys are granted at every iteration (docs/serving.md, the TP section).
    Raises ``ValueError`` for an unknown ``attention``, for a ``replan_every`` that is no number of steps >= 0
    or a ``replan_share`` or ``capture_share`` outside ``(0, 1]``."""

    buckets: Mapping[str, Sequence[int]] | None = None
    keys: Sequence[Sequence[int]] | None = None
    max_graphs: dict[str, int] | None = None
    backend: Any = "full"  # a backend name or object, as GraphRunner(backend=) takes
    device: Any = "auto"  # a device name or object, as GraphRunner(device=) takes
    debug: bool = False
    checks: Any = ("drift", "fingerprint")  # GraphRunner(checks=): names, hook objects or None
    equivalence: bool = True
    validate: bool = True
    background: bool = False
    autocapture: bool = False
    replan_every: int = 256
    replan_share: float = REPLAN_SHARE
    capture_share: float = 1.0
    attention: str = "auto"
    group: Any = None  # GraphRunner(group=): the ranks every runner agrees over (None: one rank)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_FORMS:
            raise ValueError(f"attention must be one of {list(ATTENTION_FORMS)}, got {self.attention!r}")
        every = self.replan_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"replan_every must be a number of steps >= 0 (0: never re-plan), got {every!r}")
        share = self.replan_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(
                f"replan_share must be a share of the serving time in (0, 1] (1: re-plan without rest), got {share!r}"
            )
        share = self.capture_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(
                f"capture_share must be a share of the serving time in (0, 1] (1: keys without rest), got {share!r}"
            )

    @classmethod
    def of(cls, options: BatchingOptions | None = None, **fields: Any) -> BatchingOptions:
        """``options`` (default: the defaults) with ``fields`` replaced; ``TypeError`` naming an unknown field."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(
                f"unknown continuous batching option(s) {unknown}; the options are "
                f"{[f.name for f in dataclasses.fields(cls)]}"
            )
        base = cls() if options is None else options
        if not isinstance(base, cls):
            raise TypeError(f"options must be a {cls.__name__}, got {type(base).__name__}")
        return dataclasses.replace(base, **fields) if fields else base
