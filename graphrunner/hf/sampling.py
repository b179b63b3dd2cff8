"""Sampling per request: each request's temperature, top-k and top-p, and a generator of its own.

transformers' continuous-batching engine samples a step's tokens with one
``torch.multinomial`` over the whole batch, from the default generator: a
request's draws depend on which requests shared its steps, so a ``seed``
reproduces nothing under concurrency. :class:`RequestSampler` draws each
request's token from that request's own ``torch.Generator`` (seeded from its
seed, as vLLM does), one draw per step in which the request gets a token,
with settings of its own (:class:`SamplingParams`): what a request samples is
a function of its logits and its seed alone, whatever the batch.

The arithmetic, one row at a time (:func:`warp`, :func:`draw`), in
transformers' order (``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, with the same masks): the logits divided by the
temperature, all but the ``top_k`` largest set to ``-inf`` (ties with the
``k``-th kept), then all but the smallest set of largest whose probability
reaches ``top_p`` (the largest always kept), then one draw of the softmax by
the exponential race: ``argmax(p / e)`` with ``e`` a vector of standard
exponentials from the request's generator (an exact draw of ``p``, one
exponential per vocabulary entry at each step, so the generator advances by
the same amount whatever the logits). Temperature 0 is greedy (``argmax``, no
draw). This is host code after the logits: graphs never capture it.

:class:`graphrunner.hf.model_runner.SamplingModelRunner` runs it as the step's
sampling (``graphrunner serve`` installs it on the graph server and on the
``--eager`` one alike).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["GREEDY", "RequestSampler", "SamplingParams", "draw", "warp"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: ``temperature`` (0: greedy, no draw), ``top_k`` (0: off), ``top_p`` (1: off),
    ``seed`` (the request's generator is seeded with it). ``ValueError`` naming the field for a value out of
    range: temperature a finite number >= 0, top_k an integer >= 0, top_p in (0, 1], seed an integer of 64
    bits (``torch.manual_seed``'s range)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {p!r}")
        if isinstance(s, bool) or not isinstance(s, int) or not -(2**63) <= s < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {s!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0: the largest logit, no draw."""
        return self.temperature == 0


#: Greedy: what a row without settings of its own gets.
GREEDY = SamplingParams()


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities request ``params`` samples from, for one row of ``logits`` (``[vocab]``, float):
    divided by the temperature, masked to the ``top_k`` largest (ties kept) and to the top-``p`` nucleus
    (the largest kept), softmaxed. A sampling temperature only (``params.temperature > 0``)."""
    x = logits.float() / params.temperature
    k = params.top_k
    if 0 < k < x.numel():
        kth = torch.topk(x, k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1:
        ascending, order = torch.sort(x)
        cumulative = ascending.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - params.top_p
        drop[-1] = False  # the largest is always kept
        x = x.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return x.softmax(-1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn from ``probs`` (``[vocab]``) with ``generator``: ``argmax(probs / e)``, ``e`` standard
    exponentials drawn from ``generator`` (the exponential race: token ``i`` wins with probability
    ``probs[i]``)."""
    e = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / e))


class RequestSampler:
    """The sampling settings and generators of the requests a continuous-batching engine runs, by request id.

    :meth:`add` a request's :class:`SamplingParams` before the engine sees the request, :meth:`forget` it
    once it ended; :meth:`sample` draws the tokens of a step. Thread-safe: requests are added and
    forgotten from other threads than the engine's. A request's generator is made at its first draw, on
    the device of the logits, seeded with its seed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._params: dict[str, SamplingParams] = {}
        self._generators: dict[str, torch.Generator] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Sample request ``request_id`` with ``params`` from now on (its generator starts afresh)."""
        with self._lock:
            self._params[request_id] = params
            self._generators.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """Drop what was kept of request ``request_id`` (nothing for an unknown one); its rows are greedy."""
        with self._lock:
            self._params.pop(request_id, None)
            self._generators.pop(request_id, None)

    def params(self, request_id: str) -> SamplingParams | None:
        """The settings of request ``request_id``, ``None`` for one not added (or forgotten)."""
        with self._lock:
            return self._params.get(request_id)

    def __len__(self) -> int:
        """The requests kept."""
        with self._lock:
            return len(self._params)

    def _generator(self, request_id: str, params: SamplingParams, device: torch.device) -> torch.Generator:
        with self._lock:
            g = self._generators.get(request_id)
            if g is None or g.device != device:
                g = torch.Generator(device=device)
                g.manual_seed(params.seed)
                self._generators[request_id] = g
            return g

    def sample(
        self, scores: torch.Tensor, request_ids: Sequence[str], logprobs: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens of a step: ``scores`` ``[rows, vocab]`` (row ``i`` is request ``request_ids[i]``'s; rows
        past them are padding) -> ``(tokens [rows] int64, logprobs [rows] float32 or None)``. Each row of a
        request with settings is drawn with its own generator (:func:`warp`, :func:`draw`); the others
        (greedy, unknown ids, padding) are the ``argmax``. ``logprobs``: each token's log-probability under
        the distribution it was drawn from (the softmax of ``scores`` for a greedy row), as transformers'
        sampler returns them. Every row is computed on its own: a row's token does not depend on the others."""
        tokens = scores.argmax(-1)
        lp = torch.log_softmax(scores.float(), -1) if logprobs else None
        for i, request_id in enumerate(request_ids[: scores.size(0)]):
            params = self.params(request_id)
            if params is None or params.greedy:
                continue
            probs = warp(scores[i], params)
            token = draw(probs, self._generator(request_id, params, scores.device))
            tokens[i] = token
            if lp is not None:
                lp[i, token] = torch.log(probs[token])
        out = None if lp is None else lp.gather(1, tokens[:, None]).squeeze(1)
        return tokens, out
