"""Agreement on the step's sizes: one object per runner, local or across ranks.

A runner asks its agreement, once per call, which sizes every rank runs
(:meth:`agree`), and once per capture which keys every rank can replay
(:meth:`replayable`). :class:`LocalAgreement` (one rank, or agreement off)
answers from this rank alone and makes no group call; :class:`RankAgreement`
makes exactly one collective per call: the element-wise max over the ranks
of ``[size0 - tag * 2**32, size1, ..., tag * 2 + invalid]``
(:func:`graphrunner.keys.agree`), where ``tag`` packs the call number and
the configuration digest. The tag, negated in the first element, gives
every rank both the highest and the lowest call number of the ranks in that
one collective, so ranks whose calls are no longer paired (a call on some
rank raised or was interrupted before it reached the agreement, or calls of
two runners crossed on one group) all raise
:class:`~graphrunner.keys.AgreementError` for the same call, and nothing is
replayed; the runner then refuses every later call on every rank. The
configuration digest (0 unless one is given, :func:`config_digest`) catches
calls of different runners paired at equal call numbers. A rank whose inputs
are invalid still takes part (:meth:`invalid`), so its peers raise
:class:`~graphrunner.errors.GraphRunnerError` instead of hanging.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from graphrunner.checks.fingerprint import canonical, stable_hash
from graphrunner.errors import ContractError, GraphRunnerError
from graphrunner.keys import RESYNC, AgreementError, agree_extra, all_max_vector

__all__ = ["LocalAgreement", "RankAgreement", "make_agreement", "config_digest", "config_fields"]

logger = logging.getLogger("graphrunner")

Sizes = tuple[int, ...]


def config_fields(server: Any, checks: Any) -> dict[str, Any]:
    """What every rank must configure alike for a runner (its :class:`~graphrunner.serving.Server`
    ``server`` and :class:`~graphrunner.checks.CheckSet` ``checks``): the capture fingerprint's
    fields (:mod:`graphrunner.checks.fingerprint`) and :func:`config_digest`'s input."""
    fp = server.space.fingerprint()
    fp["inputs"], fp["outputs"] = server.inputs.fingerprint(), server.layout.fingerprint()
    fp["backend"] = f"{type(server.backend).__module__}.{type(server.backend).__qualname__}"
    fp["warmups"] = getattr(server.backend, "warmups", None)
    fp["fallback"] = server.fallback
    fp["checks"] = checks.names()  # the padding check's verdict is agreed by one collective per key
    fp["verify_every"] = server.verify_every  # a verdict rides in every call's agreement when on
    return fp


def config_digest(fields: Mapping[str, Any]) -> int:
    """A 62-bit digest of a runner's configuration fields (what the capture fingerprint
    compares, :func:`config_fields`), computed once per capture, for :class:`RankAgreement`."""

    return stable_hash(canonical(dict(fields)))


class LocalAgreement:
    """This rank decides alone: no group call, ever."""

    #: True when the decision is shared with other ranks.
    shared = False

    def agree(self, sizes: Sizes, call: int, step: int | None = None) -> Sizes:
        """The sizes to run: this call's own."""
        return sizes

    def invalid(self, zero: Sizes, call: int, step: int | None = None) -> None:
        """This rank's inputs were invalid: nothing to tell anyone."""

    def replayable(self, local: Sequence[bool]) -> list[bool]:
        """Which keys can be replayed: this rank's answer."""
        return list(local)

    def verification_failed(self, call: int) -> None:
        """This rank's shadow verification of ``call`` failed: nobody else to tell."""


class RankAgreement:
    """Every rank of ``group`` runs the same sizes, for the same call (one ``all_max_vector`` per call).

    ``digest``: the runner's configuration digest (:func:`config_digest`; 0: none). ``verdicts``:
    shadow verification is on (``verify_every > 0``), so every call also carries the number of the
    last call whose verification failed on this rank and was not told yet (:meth:`verification_failed`;
    every rank raises :class:`~graphrunner.errors.ContractError` at the next call: one collective per
    call in debug mode too). A call with ``step=`` (the engine's own step number) also carries it, as
    max and min, so ranks at different steps raise :class:`~graphrunner.keys.AgreementError` together.
    After the ranks' calls were found unpaired (``AgreementError`` on every rank), :attr:`broken`
    holds that error's message and every later :meth:`agree`/:meth:`invalid` raises
    ``AgreementError`` at once, without a collective (every rank saw the same mismatch, so no rank
    waits for another)."""

    shared = True

    def __init__(self, group: Any, digest: int = 0, verdicts: bool = False) -> None:
        self.group = group
        self.rank = int(getattr(group, "rank", 0))
        self.digest = int(digest)
        self.verdicts = bool(verdicts)
        #: ``extra() -> [ints]`` this rank adds to every call's collective (a background capture's
        #: counts); their max over the ranks after the last call is :attr:`last_extra`.
        self.extra: Callable[[], list[int]] = list
        self.last_extra: list[int] = []
        #: The message of the mismatch that made this agreement refuse every call, or ``None``.
        self.broken: str | None = None
        self._failed_call = 0  # the last call whose verification failed here, not yet told (0: none)

    def verification_failed(self, call: int) -> None:
        """This rank's shadow verification of ``call`` failed (it raises ``ContractError`` itself): the
        next call's agreement tells every rank, which then all refuse that call."""
        self._failed_call = int(call)

    def agree(self, sizes: Sizes, call: int, step: int | None = None) -> Sizes:
        """The element-wise max of every rank's sizes; raises :class:`GraphRunnerError` when
        another rank passed invalid inputs (every rank then skips the step),
        :class:`~graphrunner.errors.ContractError` on every rank when a rank's shadow verification
        of an earlier call failed, and :class:`~graphrunner.keys.AgreementError` on every rank when
        the ranks' calls (or ``step`` numbers) are not paired."""
        agreed, bad = self._exchange(sizes, False, call, step)
        if bad:
            raise GraphRunnerError(
                f"rank {self.rank}: another rank passed invalid inputs at call {call}, so every rank skipped this "
                "step (see that rank's error); the runner is still usable"
            )
        return agreed

    def invalid(self, zero: Sizes, call: int, step: int | None = None) -> None:
        """Take part in the call's one collective as invalid, so the peers skip the step too
        (raises :class:`~graphrunner.keys.AgreementError` instead when the calls are not paired)."""
        self._exchange(zero, True, call, step)

    def _exchange(self, sizes: Sizes, invalid: bool, call: int, step: int | None) -> tuple[Sizes, bool]:
        """The call's one collective: sizes, tag, then the background counts, the verdict, the step."""
        if self.broken is not None:
            self._refuse(call)
        own = self.extra()
        tail = ([self._failed_call] if self.verdicts else []) + ([] if step is None else [step, -step])
        try:
            agreed, bad, out = agree_extra(self.group, sizes, invalid, call, self.digest, own + tail)
        except AgreementError as exc:
            # unpaired calls never pair again: refuse from now on. A collective that met another kind of
            # collective (the channel: a rank capturing or waiting for a capture) was no call on any rank:
            # the channel re-paired the ranks' sequence numbers and the caller does not count it
            if exc.unpaired and exc.collectives is None:
                self.broken = str(exc)
            raise
        self.last_extra, rest = out[: len(own)], out[len(own) :]
        self._failed_call = 0  # told
        if step is not None:
            hi, lo = rest[-2], -rest[-1]
            if hi != lo:
                self.broken = (
                    f"rank {self.rank} is at engine step {step} but the ranks' steps range from {lo} to "
                    f"{hi} at call {call}: a rank skipped or repeated a step, so the ranks' calls are "
                    "not paired; " + RESYNC
                )
                raise AgreementError(self.broken, steps=(step, lo, hi))
        if self.verdicts and rest[0] > 0:
            raise ContractError(
                f"rank {self.rank}: GraphRunner shadow verification of call {rest[0]} found a replay that differs "
                "from eager PyTorch (on the rank that raised ContractError at that call; see its error), so every "
                f"rank refuses call {call} (nothing was replayed). Re-capture on every rank (runner.cleanup(); "
                "runner.capture()) after making the value the graph froze a tensor input or a tensor updated "
                "in place"
            )
        return agreed, bad

    def _refuse(self, call: int) -> None:
        raise AgreementError(
            f"rank {self.rank}: call {call} refused without a collective: an earlier call found the ranks' calls of "
            f"this runner unpaired, on every rank. That error: {self.broken}",
            calls=None,
        )

    def replayable(self, local: Sequence[bool]) -> list[bool]:
        """Which keys every rank can replay: one collective at the end of capture (a max over
        "cannot replay" bits, one per key), so that per call the agreed sizes alone decide."""
        cannot = all_max_vector(self.group, [0 if ok else 1 for ok in local], "runner_replayable", "capture")
        return [bool(ok) and not bad for ok, bad in zip(local, cannot)]


def make_agreement(group: Any, enabled: bool, digest: int = 0, verdicts: bool = False) -> Any:
    """:class:`RankAgreement` over ``group`` (with configuration ``digest``; ``verdicts``: shadow
    verification is on) when it has more than one rank and ``enabled``, else :class:`LocalAgreement`."""
    if enabled and int(getattr(group, "size", 1)) > 1:
        if "nccl" in str(getattr(group, "backend_name", "")):
            logger.warning(
                "GraphRunner: bucket agreement over an NCCL group waits for the GPU on every call "
                "(its result is read on the host); pass TorchDistGroup(torch.distributed.new_group("
                "backend='gloo')) as group= for a host-only agreement"
            )
        return RankAgreement(group, digest, verdicts)
    if int(getattr(group, "size", 1)) > 1:
        logger.warning(
            "GraphRunner.agree_bucket = False on a %d-rank group: ranks may replay different buckets "
            "(unsafe; for tests only)",
            int(group.size),
        )
    return LocalAgreement()
