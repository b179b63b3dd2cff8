"""transformers' ``ModelRunner`` with the step served by graphrunner (:class:`GraphModelRunner`) and with
sampling per request (:class:`SamplingModelRunner`, :func:`sample_per_request`).

transformers' batch processor runs each step through its model runner's public
``compute_batch(model, batch_data)``: carry-over, the model's forward, logits
processing and sampling into the step's output tensor. :class:`GraphModelRunner`
is that class, built through its public constructor from the processor's own
parts, and owns the step end to end: the step's metadata (transformers'
``ContinuousBatchingIOs``) checked and turned into the graph step's inputs
(:func:`~graphrunner.hf.metadata.step_feeds`), then ``serve(feeds, size)`` (the
policy's choice of graphs or the eager step) for the logits, handed to
transformers' ``compute_batch`` as the model's output. Everything after the
forward (logits processors, sampling, log-probabilities, output) is
transformers' own code. The adapter puts one on the batch processor
(``bp.model_runner``), the one place it enters the processor.

Sampling: transformers samples a step with one ``torch.multinomial`` over the
batch from the default generator, where its model's generation config samples.
A :class:`SamplingModelRunner` (a :class:`GraphModelRunner` is one) given a
:class:`~graphrunner.hf.sampling.RequestSampler` samples each row with its
request's own settings and generator instead (its ``_sample``, transformers'
sampling step, after transformers' logits processors);
:func:`sample_per_request` puts one on any synchronous, unpadded batch
processor, transformers' own engine included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
from transformers.generation.continuous_batching.model_runner import ModelRunner

from graphrunner.hf.batch_step import CacheGroup
from graphrunner.hf.internals import check_sampling_step, step_rows
from graphrunner.hf.metadata import step_feeds
from graphrunner.hf.sampling import RequestSampler

if TYPE_CHECKING:
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

__all__ = ["GraphModelRunner", "SamplingModelRunner", "Serve", "sample_per_request"]


@dataclass
class _Logits:
    """What transformers reads of a model's output: ``.logits``."""

    logits: torch.Tensor


class _StepModel:
    """The model transformers' ``compute_batch`` calls: ``forward()``'s logits as ``[1, reqs, vocab]``."""

    def __init__(self, forward: Callable[[], torch.Tensor]) -> None:
        self.forward = forward

    def __call__(self, **batch_data: Any) -> _Logits:
        return _Logits(self.forward()[None])


#: ``serve(feeds, size) -> logits [reqs, vocab]``: the step's inputs (:func:`~graphrunner.hf.metadata.step_feeds`)
#: and its size per dim (``(tokens, keys per attention type..., reqs)``).
Serve = Callable[[dict[str, torch.Tensor], tuple[int, ...]], torch.Tensor]


class SamplingModelRunner(ModelRunner):
    """transformers' ``ModelRunner`` for batch processor ``bp``, built from ``bp``'s logits processor, batching
    config, inputs and outputs, cache and sampling flags as transformers builds its own, whose sampling step
    draws each row of the step with its request's settings and generator (``sampler``, a
    :class:`~graphrunner.hf.sampling.RequestSampler`: rows of requests it does not know are greedy), or is
    transformers' own (``sampler=None``). The rows are the step's requests that get a token, in the step's
    order (:func:`~graphrunner.hf.internals.step_rows`). The forward is transformers' (this class) or the
    graph step's (:class:`GraphModelRunner`)."""

    def __init__(self, bp: ContinuousBatchProcessor, sampler: RequestSampler | None = None) -> None:
        super().__init__(
            logit_processor=bp.logit_processor,
            cb_config=bp.cb_config,
            inputs_and_outputs=bp.inputs_and_outputs,
            cache=bp.cache,
            do_sample=bp.do_sample,
            return_logprobs=bp.return_logprobs,
        )
        #: Draws each row with its request's settings; ``None``: transformers' sampling.
        self.sampler = sampler

    def _sample(self, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        """transformers' sampling step (``scores`` ``[1, rows, vocab]`` after its logits processors, into
        ``output_ids``), per request with :attr:`sampler`."""
        if self.sampler is None:
            return super()._sample(scores, output_ids)
        tokens, logprobs = self.sampler.sample(scores[0], step_rows(self.inputs_and_outputs), self.return_logprobs)
        n = tokens.size(0)
        output_ids[0, :n].copy_(tokens)
        if logprobs is not None:  # transformers' layout: float32 log-probabilities viewed as the int32 row 1
            output_ids[1, :n].copy_(logprobs.view(dtype=torch.int32))
        return None


def sample_per_request(bp: ContinuousBatchProcessor, sampler: RequestSampler) -> SamplingModelRunner:
    """Sample the steps of batch processor ``bp`` per request with ``sampler`` (see :class:`SamplingModelRunner`):
    its model runner's sampler set when it is one (a :class:`GraphModelRunner`), else transformers' own runner
    replaced by a :class:`SamplingModelRunner` (``bp.model_runner``). Returns the runner. Raises ``ValueError``
    for a runner that pads its inputs (transformers' own CUDA graphs or compile, which would capture the host's
    sampling) or double-buffers them (asynchronous batching), ``TypeError`` for a model runner of another
    class, :class:`~graphrunner.hf.internals.TransformersChanged` where transformers' sampling step changed."""
    check_sampling_step(ModelRunner)
    mr = bp.model_runner
    if isinstance(mr, SamplingModelRunner):
        mr.sampler = sampler
        return mr
    if type(mr) is not ModelRunner:
        raise TypeError(f"the batch processor's model runner is a {type(mr).__name__}, not transformers' ModelRunner")
    if mr.pad_inputs or not isinstance(bp.inputs_and_outputs, ContinuousBatchingIOs):
        raise ValueError(
            "per-request sampling runs on the host after the forward: the manager pads its inputs for its own "
            "CUDA graphs or torch.compile, or batches asynchronously (transformers' defaults for flash attention "
            "on a GPU); build it with use_cuda_graph=False, use_async_batching=False and no compile config"
        )
    runner = bp.model_runner = SamplingModelRunner(bp, sampler)
    return runner


class GraphModelRunner(SamplingModelRunner):
    """transformers' ``ModelRunner`` for batch processor ``bp`` (built from ``bp``'s logits processor, batching
    config, inputs and outputs, cache and sampling flags, as transformers builds its own) that serves each
    varlen step: its metadata checked and turned into the graph step's inputs over the cache's ``groups``
    (:func:`~graphrunner.hf.metadata.step_feeds`, ``debug``/``validate`` as there), then ``serve(feeds,
    size)`` for the logits of the step's ``logits_indices``, which transformers' ``compute_batch`` processes and
    samples. Steps on transformers' decode fast path (a block table: flash attention only, which gr.hf refuses)
    run the model's own forward. It runs in transformers' generation thread; what it raises is handed to
    ``on_error`` first and goes on to transformers, whose generation loop stops the engine and fails every request
    (a server's manager, ``autocapture``, fails only the step's requests:
    :class:`~graphrunner.hf.batching.GraphBatching`). Raises ``TypeError`` for asynchronous batching's
    double-buffered inputs (refused: run it with ``use_async_batching=False``). Its sampling is transformers'
    own, or per request once given a ``sampler`` (:class:`SamplingModelRunner`, :func:`sample_per_request`)."""

    def __init__(
        self,
        bp: ContinuousBatchProcessor,
        groups: Sequence[CacheGroup],
        serve: Serve,
        debug: bool,
        validate: bool,
        on_error: Callable[[BaseException], None] | None = None,
        sampler: RequestSampler | None = None,
    ) -> None:
        super().__init__(bp, sampler)
        if not isinstance(self.inputs_and_outputs, ContinuousBatchingIOs):
            raise TypeError("asynchronous batching double-buffers the step's inputs: use use_async_batching=False")
        self.groups, self.serve, self.debug, self.validate = list(groups), serve, debug, validate
        self.on_error = on_error

    def supports_logits_to_keep(self, model: torch.nn.Module) -> bool:
        """True: the step returns the logits of the step's ``logits_indices`` only (transformers slices none)."""
        return True

    def step_inputs(self) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
        """``(feeds, size)`` of the step transformers prepared: the graph step's inputs and its size per dim."""
        io = self.inputs_and_outputs
        assert isinstance(io, ContinuousBatchingIOs)  # checked at construction
        feeds = step_feeds(io, self.cache, self.groups, debug=self.debug, validate=self.validate)
        size = (
            int(io.total_seqlen_q),
            *(int(feeds[f"read_index_{g.index}"].shape[0]) for g in self.groups),
            int(io.num_request_in_batch),
        )
        return feeds, size

    def compute_batch(self, model: torch.nn.Module, batch_data: dict) -> None:
        """transformers' ``compute_batch`` with the served step as the model's forward (not on the decode fast
        path)."""
        if self.inputs_and_outputs.use_block_table:
            return super().compute_batch(model, batch_data)
        return super().compute_batch(_StepModel(self._serve), batch_data)  # type: ignore[arg-type]

    def _serve(self) -> torch.Tensor:
        try:
            return self.serve(*self.step_inputs())
        except BaseException as exc:
            if self.on_error is not None:
                self.on_error(exc)
            raise
