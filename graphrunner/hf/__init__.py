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
with the forward of each step replayed from graphs (:mod:`~graphrunner.hf.batching`,
``docs/continuous-batching.md``).

The lower-level helpers (:func:`make_static_cache`, :func:`cache_tensors`,
:func:`snapshot_cache`, :func:`restore_cache`, :func:`compare_caches`,
:func:`prefill`, :func:`make_decode_step`, :func:`decode_inputs`) are public
for tools that drive the cache themselves (``examples/hf_llama.py``).
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401  (the extra is required)
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("graphrunner.hf needs transformers: pip install 'graphrunner[hf]' "
                      "(or pip install transformers)") from exc

from graphrunner.hf.cache import (cache_tensors, compare_caches, make_static_cache, restore_cache,
                                  snapshot_cache, zero_cache)
from graphrunner.hf.batching import (BatchingStats, GraphBatching, MetadataError, generate_batch,
                                     init_continuous_batching)
from graphrunner.hf.decode import KNOWN_BAD, VERIFIED_TRANSFORMERS_MAJOR, DecodeRunner, DecodeStats
from graphrunner.hf.steps import decode_inputs, make_decode_step, prefill

__all__ = [
    "DecodeRunner",
    "generate_batch",
    "init_continuous_batching",
    "GraphBatching",
    "BatchingStats",
    "MetadataError",
    "DecodeStats",
    "KNOWN_BAD",
    "VERIFIED_TRANSFORMERS_MAJOR",
    "make_static_cache",
    "cache_tensors",
    "snapshot_cache",
    "restore_cache",
    "zero_cache",
    "compare_caches",
    "prefill",
    "make_decode_step",
    "decode_inputs",
]


def __getattr__(name: str):
    if name == "SUPPORTED_MODEL_TYPES":
        raise AttributeError("gr.hf.SUPPORTED_MODEL_TYPES is gone: DecodeRunner accepts every architecture whose "
                             "decode step passes the capture checks and the self-test (see gr.hf.KNOWN_BAD)")
    raise AttributeError(f"module 'graphrunner.hf' has no attribute {name!r}")
