"""Choosing the next token from a decode step's logits, outside the graph, as ``model.generate`` does.

Greedy: ``argmax``. Sampling: the logits of the last position in float32,
then transformers' own warpers in ``model.generate``'s order (temperature,
top-k, top-p; each only when set and not neutral), ``softmax`` and one
``torch.multinomial`` draw per step from ``generator`` (the default
generator when None). With the same generator state, a sampled
:meth:`~graphrunner.hf.DecodeRunner.generate` equals ``model.generate`` with
``do_sample=True`` after ``torch.manual_seed`` token for token (tested):
the graphs consume no random numbers.
"""

from __future__ import annotations

import copy
from typing import Any, List, Optional

import torch

#: generation-config fields (with their neutral values) whose logits processors ``model.generate`` applies
#: and this module does not: greedy or sampled, a config that sets one is refused.
UNSUPPORTED = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
               "forced_bos_token_id": None, "forced_eos_token_id": None, "min_length": 0, "min_new_tokens": None,
               "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
               "exponential_decay_length_penalty": None, "renormalize_logits": False}
#: the same, only applied when sampling
UNSUPPORTED_SAMPLING = {"min_p": None, "typical_p": 1.0, "top_h": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


def unsupported_fields(generation_config: Any, do_sample: bool = False) -> List[str]:
    """``name=value`` of every field of ``generation_config`` that asks for a processor :class:`TokenChooser`
    does not apply (empty: its tokens can equal ``model.generate``'s)."""
    fields = {**UNSUPPORTED, **(UNSUPPORTED_SAMPLING if do_sample else {})}
    found = []
    for name, neutral in fields.items():
        value = getattr(generation_config, name, neutral)
        if value is not None and value != neutral and value != []:
            found.append(f"{name}={value!r}")
    return found


class TokenChooser:
    """``chooser(tokens_so_far, logits) -> [B, 1]`` next tokens: greedy, or sampled with ``generator``.

    ``model``'s ``generation_config`` gives the defaults, overridden by the
    keyword arguments that are not None (``temperature``, ``top_k``,
    ``top_p``), as ``model.generate(**kwargs)`` merges them. Raises
    ``ValueError`` for a non-positive temperature, a negative top-k, a top-p
    outside (0, 1], and for a generation config that asks for a processor
    this chooser does not apply (:func:`unsupported_fields`, e.g.
    ``repetition_penalty`` or ``forced_eos_token_id``), greedy or not.
    """

    def __init__(self, model: Any, do_sample: bool = False, temperature: Optional[float] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 generator: Optional[torch.Generator] = None) -> None:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        gc = copy.deepcopy(getattr(model, "generation_config", None))
        pick = (lambda name, given: given if given is not None else getattr(gc, name, None))
        temperature, top_k, top_p = pick("temperature", temperature), pick("top_k", top_k), pick("top_p", top_p)
        self.do_sample = bool(do_sample)
        self.generator = generator
        self.warpers: List[Any] = []
        found = unsupported_fields(gc, self.do_sample)
        if found:
            raise ValueError(f"the model's generation_config sets {', '.join(found)}, whose logits processors "
                             f"DecodeRunner does not apply (it applies temperature, top_k and top_p), so its tokens "
                             f"would differ from model.generate: reset them on model.generation_config, or decode "
                             f"with model.generate()")
        if not self.do_sample:
            return
        if temperature is not None and not temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
            raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if temperature is not None and temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k is not None and top_k != 0:
            self.warpers.append(TopKLogitsWarper(top_k=top_k))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=top_p))

    def __call__(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each row, ``[B, 1]`` long, from ``logits`` ``[B, T, V]`` and the tokens so far ``[B, S]``."""
        scores = logits[:, -1].to(copy=True, dtype=torch.float32)
        if not self.do_sample:
            return scores.argmax(-1, keepdim=True)
        for warp in self.warpers:
            scores = warp(tokens, scores)
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=self.generator)
