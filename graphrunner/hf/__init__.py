"""Hugging Face causal LMs: decoding with a graph-captured one-token step (``gr.hf``).

Needs ``transformers`` (the ``hf`` extra); ``import graphrunner`` does not.
:class:`DecodeRunner` builds a ``transformers.StaticCache`` of ``max_batch``
rows, captures the one-token decode step per batch bucket through
:class:`graphrunner.GraphRunner` on the *empty* cache, checks the replayed
steps against the model's own eager decode (the self-test), then empties the
cache in place (the graphs hold its tensors' addresses; the capture
protocol's eager warmups really write it).

Any architecture is accepted whose decode step passes the capture checks
and the self-test; :data:`KNOWN_BAD` names the few no check can see. The
attention masks are built inside the step from tensors the runner owns
(:mod:`graphrunner.hf.masks`), which covers sliding windows and left-padded
prompts. The modules: :mod:`~graphrunner.hf.cache` (the static cache, views
per bucket), :mod:`~graphrunner.hf.steps` (prefill and decode steps),
:mod:`~graphrunner.hf.masks`, :mod:`~graphrunner.hf.selftest`,
:mod:`~graphrunner.hf.generation` (``generate``'s arguments resolved by
transformers' own code: defaults, logits processors, stopping criteria) and
:mod:`~graphrunner.hf.decode`. :meth:`DecodeRunner.generate` takes
``model.generate``'s arguments.

:func:`generate_batch` and :func:`init_continuous_batching` serve transformers'
own continuous batching (``model.generate_batch``, paged cache, varlen steps)
with the forward of each step replayed from graphs (:class:`GraphBatching`,
its options one :class:`BatchingOptions`; ``docs/continuous-batching.md``);
:func:`refusal` says why a model is not served, :func:`release` frees what
``generate_batch`` keeps for its next call. Their modules:
:mod:`~graphrunner.hf.entrypoints`, :mod:`~graphrunner.hf.batching` (the hook),
:mod:`~graphrunner.hf.options`, :mod:`~graphrunner.hf.refusals`,
:mod:`~graphrunner.hf.batch_step` (with :mod:`~graphrunner.hf.attention`, the attention through transformers' AttentionInterface), :mod:`~graphrunner.hf.internals`, :mod:`~graphrunner.hf.metadata`,
:mod:`~graphrunner.hf.planning`, :mod:`~graphrunner.hf.ladder`,
:mod:`~graphrunner.hf.equivalence`.

The lower-level helpers that drive a ``StaticCache`` by hand (``examples/hf_llama.py``,
the benchmarks) are imported from their modules: :mod:`graphrunner.hf.cache`
(``make_static_cache``, ``cache_tensors``, ``snapshot_cache``, ``restore_cache``,
``zero_cache``, ``compare_caches``) and :mod:`graphrunner.hf.steps` (``prefill``,
``make_decode_step``, ``decode_inputs``).
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401  (the extra is required)
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "graphrunner.hf needs transformers: pip install 'graphrunner[hf]' (or pip install transformers)"
    ) from exc

from graphrunner.hf.batching import BatchingStats, GraphBatching
from graphrunner.hf.decode import KNOWN_BAD, DecodeRunner, DecodeStats
from graphrunner.hf.entrypoints import generate_batch, graphs_of, init_continuous_batching, release
from graphrunner.hf.metadata import MetadataError
from graphrunner.hf.options import BatchingOptions
from graphrunner.hf.refusals import refusal

__all__ = [
    "DecodeRunner",
    "DecodeStats",
    "KNOWN_BAD",
    "generate_batch",
    "graphs_of",
    "init_continuous_batching",
    "release",
    "refusal",
    "GraphBatching",
    "BatchingOptions",
    "BatchingStats",
    "MetadataError",
]
