"""Agreement on the step's sizes: one object per runner, local or across ranks.

A runner asks its agreement, once per call, which sizes every rank runs
(:meth:`agree`), and once per capture which keys every rank can replay
(:meth:`replayable`). :class:`LocalAgreement` (one rank, or agreement off)
answers from this rank alone and makes no group call; :class:`RankAgreement`
makes exactly one collective per call: the element-wise max of
``[*sizes, invalid]`` over the ranks (:func:`graphrunner.keys.agree`). A
rank whose inputs are invalid still takes part (:meth:`invalid`), so its
peers raise :class:`~graphrunner.errors.GraphRunnerError` instead of hanging.
"""

from __future__ import annotations

import logging
from typing import Any, List, Sequence, Tuple

from graphrunner.errors import GraphRunnerError
from graphrunner.keys import agree, all_max_vector

__all__ = ["LocalAgreement", "RankAgreement", "make_agreement"]

logger = logging.getLogger("graphrunner")

Sizes = Tuple[int, ...]


class LocalAgreement:
    """This rank decides alone: no group call, ever."""

    #: True when the decision is shared with other ranks.
    shared = False

    def agree(self, sizes: Sizes, call: int) -> Sizes:
        """The sizes to run: this call's own."""
        return sizes

    def invalid(self, zero: Sizes, call: int) -> None:
        """This rank's inputs were invalid: nothing to tell anyone."""

    def replayable(self, local: Sequence[bool]) -> List[bool]:
        """Which keys can be replayed: this rank's answer."""
        return list(local)


class RankAgreement:
    """Every rank of ``group`` runs the same sizes (one ``all_max_vector`` per call)."""

    shared = True

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = int(getattr(group, "rank", 0))

    def agree(self, sizes: Sizes, call: int) -> Sizes:
        """The element-wise max of every rank's sizes; raises :class:`GraphRunnerError` when
        another rank passed invalid inputs (every rank then skips the step)."""
        agreed, bad = agree(self.group, sizes, False, call)
        if bad:
            raise GraphRunnerError(
                f"rank {self.rank}: another rank passed invalid inputs at call {call}, so every rank skipped this "
                "step (see that rank's error); the runner is still usable")
        return agreed

    def invalid(self, zero: Sizes, call: int) -> None:
        """Take part in the call's one collective as invalid, so the peers skip the step too."""
        agree(self.group, zero, True, call)

    def replayable(self, local: Sequence[bool]) -> List[bool]:
        """Which keys every rank can replay: one collective at the end of capture (a max over
        "cannot replay" bits, one per key), so that per call the agreed sizes alone decide."""
        cannot = all_max_vector(self.group, [0 if ok else 1 for ok in local], "runner_replayable", "capture")
        return [bool(ok) and not bad for ok, bad in zip(local, cannot)]


def make_agreement(group: Any, enabled: bool) -> Any:
    """:class:`RankAgreement` over ``group`` when it has more than one rank and ``enabled``,
    else :class:`LocalAgreement`."""
    if enabled and int(getattr(group, "size", 1)) > 1:
        if "nccl" in str(getattr(group, "backend_name", "")):
            logger.warning("GraphRunner: bucket agreement over an NCCL group waits for the GPU on every call "
                           "(its result is read on the host); pass TorchDistGroup(torch.distributed.new_group("
                           "backend='gloo')) as group= for a host-only agreement")
        return RankAgreement(group)
    if int(getattr(group, "size", 1)) > 1:
        logger.warning("GraphRunner.agree_bucket = False on a %d-rank group: ranks may replay different buckets "
                       "(unsafe; for tests only)", int(group.size))
    return LocalAgreement()
