"""Every use gr.hf makes of a transformers internal (a name transformers does not document), in one place.

Each function below reads or calls one internal; nothing else in graphrunner
imports or touches it. :data:`CHECKED_WITH` names the transformers versions
they were checked on; :func:`check` runs at every entry point (before a
manager is built) and raises :class:`~graphrunner.errors.GraphRunnerError`
naming the internal and those versions when a release changed one, instead of
failing mid-serving. ``docs/continuous-batching.md`` ("transformers internals")
lists them with the test that fails when transformers changes each.
"""

from __future__ import annotations

from typing import Any

from graphrunner.errors import GraphRunnerError

__all__ = ["CHECKED_WITH", "INTERNALS", "attention_implementation", "check", "forget_kept_manager", "kept_manager"]

#: The transformers versions these internals were checked on.
CHECKED_WITH = "5.25"

#: ``name -> what it is for``: the internals gr.hf uses.
INTERNALS = {
    "PretrainedConfig._attn_implementation": (
        "the attention implementation a model runs (no public getter; set_attn_implementation is the setter)"
    ),
    "ContinuousMixin._cached_continuous_batching_manager": (
        "where manager.stop(keep_for_next_session=True) keeps a manager for the model's next generate_batch: "
        "gr.hf keeps its own managers, so it takes them out of that slot"
    ),
}


def kept_manager(model: Any) -> Any:
    """The manager transformers keeps on ``model`` for its next ``generate_batch`` (``None``: none)."""
    return getattr(model, "_cached_continuous_batching_manager", None)


def forget_kept_manager(model: Any, manager: Any) -> None:
    """Take ``manager`` out of the slot where ``manager.stop(keep_for_next_session=True)`` keeps it on ``model``
    (``model.generate_batch`` and ``model.init_continuous_batching`` would run it); another manager stays."""
    if kept_manager(model) is manager:
        del model._cached_continuous_batching_manager


def attention_implementation(model: Any) -> str | None:
    """The attention implementation ``model`` runs (``sdpa``, ``paged|eager``, ...): its config's
    ``_attn_implementation`` (transformers' internal)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def check(model: Any) -> None:
    """Raise :class:`~graphrunner.errors.GraphRunnerError` naming the first internal of :data:`INTERNALS` that
    ``model`` (a transformers model) does not have as gr.hf expects it, with the versions it was checked on."""
    config = getattr(model, "config", None)
    if config is None or not isinstance(getattr(config, "_attn_implementation", None), str):
        _changed("PretrainedConfig._attn_implementation")


def _changed(name: str) -> None:
    import transformers

    raise GraphRunnerError(
        f"transformers {transformers.__version__} changed {name} ({INTERNALS[name]}), which gr.hf relies on: "
        f"install transformers {CHECKED_WITH} (pip install 'transformers=={CHECKED_WITH}.*'), the version it was "
        "checked on"
    )
