"""Shadow verification: after capture, run a sampled call eagerly as well and compare.

The capture-time checks see the step as it is at capture. After capture
nothing watches: a Python value the step reads that changes later (a config
attribute), or a recurrent state kept by re-binding an attribute
(``self.prev = h``), makes every replay return the capture-time value,
silently. ``GraphRunner(verify_every=N)`` (or ``GRAPHRUNNER_VERIFY_EVERY=N``;
``debug=True`` means every call unless ``verify_every`` says otherwise)
verifies every N-th call: right before the replay, the step runs eagerly on a
copy of the same padded inputs (before, so that state it updates is seen as
the replay sees it), with everything it writes outside itself put back
afterwards (:class:`~graphrunner.recording.ops.WriteGuard`: the KV cache,
counters), drawing from copies of the engine's generators (never from the
generators themselves, so the replay draws what an eager call would), and its
real output cells are compared with the replay's. A difference raises :class:`~graphrunner.errors.ContractError`
with what ``runner.compare`` finds (the first op whose output differs, its
line, the values). With several ranks every rank verifies the same calls
(the call counter is paired across ranks); a rank whose replay differs raises
at once, and its verdict rides in the next call's agreement (no collective of
its own: every call makes exactly one), where every rank raises
``ContractError`` and nothing is replayed.

Cost per verified call: one eager forward of the padded step, plus a
snapshot of what it writes; nothing on the other calls.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from graphrunner._pytree import flatten
from graphrunner.checks.compare import compare_runner
from graphrunner.checks.padding import real_cells
from graphrunner.checks.tolerance import difference
from graphrunner.errors import ContractError
from graphrunner.recording.ops import OpRecorder, WriteGuard
from graphrunner.tape.rng import OwnedGenerators

__all__ = ["verify_every_setting", "shadow_reference", "shadow_verify"]


def verify_every_setting(verify_every: int | None, debug: bool) -> int:
    """``GraphRunner(verify_every=...)`` as an int (0: off): the argument, else
    ``$GRAPHRUNNER_VERIFY_EVERY``, else 1 in debug mode, else 0. Raises ``ValueError``/``TypeError``
    for anything but an int >= 0."""
    if verify_every is None:
        env = os.environ.get("GRAPHRUNNER_VERIFY_EVERY", "").strip()
        if env:
            try:
                verify_every = int(env)
            except ValueError:
                raise ValueError(f"GRAPHRUNNER_VERIFY_EVERY must be an int >= 0, got {env!r}") from None
        else:
            return 1 if debug else 0
    if isinstance(verify_every, bool) or not isinstance(verify_every, int):
        raise TypeError(f"verify_every must be an int >= 0 (0: off) or None, got {verify_every!r}")
    if verify_every < 0:
        raise ValueError(f"verify_every must be >= 0 (0: off), got {verify_every}")
    return verify_every


def shadow_reference(server: Any, sizes: tuple[int, ...], key: tuple[int, ...]) -> list[torch.Tensor]:
    """The eager reference of a call about to replay ``key`` with real ``sizes``: the step on a copy of
    the key's padded static inputs, run BEFORE the replay (so state the step updates, a counter or
    an accumulator, is seen as the replay will see it) and with everything it writes outside
    itself put back; the real cells of each output leaf."""

    views = server.inputs.key_views(key)
    padded = {k: v.clone() for k, v in views.items()}
    # the reference draws from copies of the engine's generators (read here, on the calling thread,
    # before the replay draws from them): never set, so the replay draws what an eager call would
    guard = WriteGuard(list(views.values()) + list(padded.values()), generators=OwnedGenerators())
    try:
        with torch.inference_mode(), OpRecorder([guard]):
            ref = server.step(**padded)
        spec, leaves = flatten(ref)
        dims = server.layout.leaf_dims(spec, len(leaves))
        return [real_cells(t, d, sizes).clone() for t, d in zip(leaves, dims)]
    finally:
        guard.restore()


def shadow_verify(
    server: Any,
    ref_leaves: list[torch.Tensor],
    tensors: list[torch.Tensor],
    sizes: tuple[int, ...],
    key: tuple[int, ...],
    out: Any,
) -> None:
    """Compare a replayed call's ``out`` (sliced to ``sizes``) with its :func:`shadow_reference`.
    Raises :class:`ContractError` naming the key, the output and (from :func:`compare_runner
    <graphrunner.checks.compare.compare_runner>`) the first differing op and line."""

    _, got = flatten(out)
    worst: tuple[int, float] | None = None
    for i, (a, b) in enumerate(zip(got, ref_leaves)):
        d = difference(a.detach(), b, tolerant=True)
        if d is not None and (worst is None or d > worst[1]):
            worst = (i, d)
    if worst is None:
        return
    call = server.calls
    server.agreement.verification_failed(call)  # every rank refuses the next call (its agreement)
    ext = server.space.external(key)
    where = (
        " The other ranks raise ContractError at their next call. (Localising the difference replays the "
        "step, whose collectives the other ranks would not join: run runner.compare(...) on a one-rank runner.)"
    )
    if server.world_size == 1:
        try:
            rep = compare_runner(server, dict(zip(server.inputs.names, tensors)), atol=0.0)
            where = f" {rep}" if not rep.equal else ""
        except Exception as exc:  # noqa: BLE001 - the mismatch is the error; localising it is a bonus
            where = f" (localising it failed: {type(exc).__name__}: {exc})"
    raise ContractError(
        f"GraphRunner shadow verification of call {call}: the replay of {server.key_text(key)} (key "
        f"{ext!r}) differs from eager PyTorch on the same padded inputs by up to {worst[1]:.6g} in output leaf "
        f"{worst[0]}: the graph replays something the step no longer computes (a Python value changed after "
        "capture, an attribute re-bound to a new tensor, state kept outside tensors the graph holds). Re-capture "
        "after such changes (runner.cleanup(); runner.capture()), or make the value a tensor input or a tensor "
        f"updated in place.{where}"
    )
