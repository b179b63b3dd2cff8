"""transformers' ``ModelRunner`` with the step's forward served by graphrunner: :class:`GraphModelRunner`.

transformers' batch processor runs each step through its model runner's public
``compute_batch(model, batch_data)``: carry-over, the model's forward, logits
processing and sampling into the step's output tensor. :class:`GraphModelRunner`
is that class, built through its public constructor from the processor's own
parts, with one difference: the forward is a function of the step's inputs
(``forward(batch_data) -> logits [reqs, vocab]``, the graphs or the eager step),
handed to transformers' ``compute_batch`` as the model it calls. Everything else
(logits processors, sampling, log-probabilities, output) is transformers' own
code. The adapter puts one on the batch processor (``bp.model_runner``), the one
place it enters the processor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.generation.continuous_batching.model_runner import ModelRunner

if TYPE_CHECKING:
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

__all__ = ["GraphModelRunner"]


@dataclass
class _Logits:
    """What transformers reads of a model's output: ``.logits``."""

    logits: torch.Tensor


class _StepModel:
    """The model transformers' ``compute_batch`` calls: ``forward(batch_data)``'s logits as ``[1, reqs, vocab]``."""

    def __init__(self, forward: Callable[[dict[str, Any]], torch.Tensor], batch_data: dict[str, Any]) -> None:
        self.forward, self.batch_data = forward, batch_data

    def __call__(self, **batch_data: Any) -> _Logits:
        return _Logits(self.forward(self.batch_data)[None])


class GraphModelRunner(ModelRunner):
    """transformers' ``ModelRunner`` for batch processor ``bp`` (built from ``bp``'s logits processor, batching
    config, inputs and outputs, cache and sampling flags, as transformers builds its own), whose varlen steps'
    forward is ``forward(batch_data) -> logits [reqs, vocab]`` (the logits of the step's ``logits_indices``).
    Steps on transformers' decode fast path (a block table: flash attention only, which gr.hf refuses) run
    the model's own forward. ``forward`` runs in transformers' generation thread; what it raises fails the
    step's requests there, as transformers' own forward would."""

    def __init__(self, bp: ContinuousBatchProcessor, forward: Callable[[dict[str, Any]], torch.Tensor]) -> None:
        super().__init__(
            logit_processor=bp.logit_processor,
            cb_config=bp.cb_config,
            inputs_and_outputs=bp.inputs_and_outputs,
            cache=bp.cache,
            do_sample=bp.do_sample,
            return_logprobs=bp.return_logprobs,
        )
        self.forward = forward

    def supports_logits_to_keep(self, model: torch.nn.Module) -> bool:
        """True: the forward returns the logits of the step's ``logits_indices`` only (transformers slices none)."""
        return True

    def compute_batch(self, model: torch.nn.Module, batch_data: dict) -> None:
        """transformers' ``compute_batch`` with :attr:`forward` as the model's forward (not on the decode fast path)."""
        if self.inputs_and_outputs.use_block_table:
            return super().compute_batch(model, batch_data)
        return super().compute_batch(_StepModel(self.forward, batch_data), batch_data)  # type: ignore[arg-type]
