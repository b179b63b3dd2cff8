"""``DecodeRunner``: decoding a transformers causal LM whose one-token step replays as a captured graph.

Acceptance is by measurement, not by a list of architectures: ``capture()``
runs the library's capture checks (drift, padding, unsafe ops) on the decode
step of every bucket and then the self-test of :mod:`graphrunner.hf.selftest`
(replayed steps against the model's own eager decode); a model that fails
either is refused with a :class:`~graphrunner.errors.CaptureError` naming the
architecture and the failed check. :data:`KNOWN_BAD` lists the few
architectures whose problem no check can see, each with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from graphrunner.buckets import default_buckets, validate_buckets
from graphrunner.devices import get_device
from graphrunner.errors import CaptureError, GraphRunnerError
from graphrunner.hf.cache import (cache_tensors, cache_was_written, layer_problem, make_static_cache, row_view_cache,
                                  widen_sliding_layers, zero_cache, zero_tensors)
from graphrunner.hf.masks import MaskPlan, plan_masks
from graphrunner.hf.sampling import TokenChooser
from graphrunner.hf.selftest import SelfTestResult, run_self_test
from graphrunner.hf.steps import make_masked_step, masked_inputs, prefill
from graphrunner.runner import GraphRunner

#: The transformers major version whose cache layout DecodeRunner is written for.
VERIFIED_TRANSFORMERS_MAJOR = 5

#: ``config.model_type`` -> why :class:`DecodeRunner` refuses it although every check would pass:
#: problems that only show beyond the self-test's few steps or outside the decode step.
KNOWN_BAD: Dict[str, str] = {
    "gpt_neo": ("its local-attention layers attend a window of config.window_size tokens that neither "
                "config.layer_types nor config.sliding_window describes, so the step's causal mask ignores it; "
                "within the window (the self-test's few steps) the tokens agree, past it they differ"),
}


def _transformers_version() -> str:
    """The installed transformers' version string."""
    import transformers

    return str(getattr(transformers, "__version__", "0"))


@dataclass
class DecodeStats:
    """Counters of a :class:`DecodeRunner`: ``generate_calls``, ``tokens`` generated (real rows, EOS padding
    included), ``replays`` and ``eager_steps`` (decode steps served by a graph / eagerly), ``self_test``
    (the capture self-test's result, None before capture) and ``masks`` (who builds the attention masks)."""

    generate_calls: int = 0
    tokens: int = 0
    replays: int = 0
    eager_steps: int = 0
    self_test: Optional[SelfTestResult] = None
    masks: str = ""
    per_bucket: Dict[int, int] = field(default_factory=dict)


class DecodeRunner:
    """Decoding of a transformers causal LM whose one-token step replays as a captured graph.

    ``DecodeRunner(model, max_batch, max_cache_len, buckets=None, backend="full", device="auto", self_test=True)``
    builds a ``StaticCache`` of ``max_batch`` rows and ``max_cache_len``
    slots for ``model`` (an eval-mode ``*ForCausalLM`` on ``device``) and a
    :class:`GraphRunner` over the decode step with ``buckets`` (default:
    ``default_buckets(max_batch)``; the largest must be ``max_batch``).
    Nothing is captured until :meth:`capture` (or the first
    :meth:`generate`). ``self_test=False`` skips the capture self-test (the
    capture checks still run); only for models already verified.

    Limits, stated up front: one sequence per row, prompts left-padded to
    one length (``attention_mask``), greedy or temperature/top-k/top-p
    sampling (no beams, no repetition penalty), the prompt prefilled eagerly
    and only the one-token decode step replayed. Raises ``ValueError`` for
    bad sizes.
    """

    def __init__(self, model, max_batch: int, max_cache_len: int, buckets: Optional[Sequence[int]] = None,
                 backend: Any = "full", device: Any = "auto", self_test: bool = True) -> None:
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if not isinstance(max_cache_len, int) or max_cache_len < 2:
            raise ValueError(f"max_cache_len must be an int >= 2 (prompt + new tokens), got {max_cache_len!r}")
        if buckets is None:
            buckets = default_buckets(max_batch)
        buckets = validate_buckets(buckets)  # GraphRunner's rules, checked before anything is built
        if buckets[-1] != max_batch:
            raise ValueError(f"the largest bucket must equal max_batch={max_batch}, got buckets {buckets}: "
                             f"add {max_batch} or lower max_batch")
        self.model = model
        self.max_batch = max_batch
        self.max_cache_len = max_cache_len
        self.self_test = bool(self_test)
        self.model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        self.device = get_device(device)
        self.cache = None
        self.plan = plan_masks(model.config)
        self._views: Dict[int, Any] = {}
        self._report = None
        self.stats = DecodeStats(masks="step" if self.plan.explicit else f"model ({self.plan.reason})")
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.vocab_size = getattr(emb, "num_embeddings", None) or getattr(model.config, "vocab_size", None)
        step = make_masked_step(model, self._view, lambda: self.plan, max_cache_len)
        self.runner = GraphRunner(step, inputs=masked_inputs(self.vocab_size, max_cache_len), buckets=buckets,
                                  backend=backend, device=self.device, progress=False, fallback="error")
        self.buckets: List[int] = list(self.runner.buckets)

    # ------------------------------------------------------------------ internals
    def _view(self, rows: int):
        if rows not in self._views:
            self._views[rows] = row_view_cache(self.cache, rows, self.max_batch)
        return self._views[rows]

    def _refuse(self, why: str) -> CaptureError:
        return CaptureError(f"gr.hf.DecodeRunner cannot capture architecture {self.model_type!r}: {why}")

    def _check_version(self) -> None:
        version = _transformers_version()
        head = version.split(".")[0]
        if not head.isdigit() or int(head) < VERIFIED_TRANSFORMERS_MAJOR:
            raise CaptureError(f"gr.hf.DecodeRunner is verified on transformers {VERIFIED_TRANSFORMERS_MAJOR}.x, found "
                               f"{version}: older versions keep cache state in other objects "
                               f"(e.g. MambaCache), which the graphs would not reset. Upgrade with "
                               f"pip install 'graphrunner[hf]', or decode with model.generate()")
        if self.model_type in KNOWN_BAD:
            raise self._refuse(f"{KNOWN_BAD[self.model_type]} (gr.hf.KNOWN_BAD); decode it with model.generate()")

    def _allocate(self) -> None:
        """Allocate the ``max_batch`` cache with one eager dummy token, check its layers, then zero it."""
        try:
            self.cache = make_static_cache(self.model, self.max_batch, self.max_cache_len)
        except Exception as exc:  # transformers refuses configs it has no static cache for
            raise self._refuse(f"transformers cannot build a StaticCache for it ({type(exc).__name__}: {exc})") from exc
        if getattr(self.cache, "layers", None) is None:
            raise self._refuse("this transformers version's StaticCache has no per-layer objects (transformers "
                               ">= 4.56 needed for padded buckets); upgrade it")
        widen_sliding_layers(self.cache, self.max_cache_len)
        dev = self.model.device
        try:
            prefill(self.model, self.cache, torch.zeros((self.max_batch, 1), dtype=torch.long, device=dev))
        except Exception as exc:
            raise self._refuse(f"its forward over a StaticCache failed ({type(exc).__name__}: {exc})") from exc
        try:
            cache_tensors(self.cache)
            if not cache_was_written(self.cache):
                raise ValueError("no layer's write counter or state flag moved")
        except ValueError as exc:
            raise self._refuse("the StaticCache stayed empty after a forward: the model keeps no state in it "
                               "(it ignores past_key_values), so a decode step would recompute nothing; decode "
                               "it with model.generate()") from exc
        for i, layer in enumerate(self.cache.layers):
            problem = layer_problem(layer, self.max_batch)
            if problem:
                raise self._refuse(f"cache layer {i}: {problem}")
        if self.plan.explicit:
            self._probe_masks()
        # Zero the tensors but keep linear-attention layers' has_previous_state set, so that every warmup and
        # the capture run the one-token update branch that each decode step after a prefill takes.
        zero_tensors(self.cache)

    def _probe_masks(self) -> None:
        """Run one eager decode step with the step's masks; a model whose forward does not take them (a
        state-space model expecting a 2D padding mask, ...) builds its masks itself instead (``plan.kind="model"``)."""
        dev = self.model.device
        zeros = torch.zeros((1, 1), dtype=torch.long, device=dev)
        try:
            self.runner.step(input_ids=zeros, position_ids=zeros, cache_position=zeros + 1, first_slot=zeros)
        except Exception as exc:  # measured: the forward rejects the masks
            self.plan = MaskPlan("model", reason=f"its forward does not take 4D attention masks "
                                                 f"({type(exc).__name__}: {str(exc)[:120]})")
            self.stats.masks = f"model ({self.plan.reason})"

    def _prefill(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Prefill ``input_ids`` eagerly into rows ``[0, B)`` of the (emptied) cache; return the logits."""
        return prefill(self.model, self._view(input_ids.shape[0]), input_ids, attention_mask)

    def _reset_cache(self) -> None:
        """Empty the cache in place (the graphs keep the same tensors): after capture and the self-test, and
        before every :meth:`generate` (also clearing ``has_previous_state``, see :func:`zero_cache`)."""
        zero_cache(self.cache)

    # ------------------------------------------------------------------ API
    def capture(self):
        """Capture the decode step for every bucket, run the self-test; return GraphRunner's ``CaptureReport``.

        Raises :class:`CaptureError` naming the architecture and the reason
        when the model cannot be captured safely: a capture check failed
        (state Python would freeze, padding leaking into real rows, an op a
        graph cannot hold), a cache layer a graph cannot keep in place, a
        model that ignores the cache, an entry of :data:`KNOWN_BAD`, or the
        self-test found replayed logits that differ from the model's own
        eager decode. The cache is emptied afterwards. Calling it again
        returns the first report.
        """
        if self._report is not None:
            return self._report
        self._check_version()
        with torch.inference_mode():
            self._allocate()
            try:
                report = self.runner.capture()
            except GraphRunnerError as exc:
                raise self._refuse(f"{exc}") from exc
            finally:
                self._reset_cache()
            if self.self_test:
                try:
                    self.stats.self_test = run_self_test(self)
                except CaptureError:
                    self.runner.cleanup()
                    raise
        self._report = report
        return report

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: Optional[torch.Tensor] = None,
                 do_sample: bool = False, temperature: Optional[float] = None, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Return ``[B, P + new]`` tokens: the prompt, then up to ``max_new_tokens`` new ones per row.

        ``input_ids`` ``[B, P]`` long, ``1 <= B <= max_batch``;
        ``attention_mask`` ``[B, P]`` 0/1 marks left padding (each row: zeros,
        then ones; ragged prompts need a model whose masks the step builds,
        ``stats.masks == "step"``). Greedy by default; ``do_sample=True`` draws
        with ``generator`` after temperature/top-k/top-p (defaults from the
        model's ``generation_config``, see :class:`~graphrunner.hf.sampling.TokenChooser`).
        A row that emits an EOS id continues with the pad id, and decoding
        stops early once every row has finished. Equals
        ``model.generate(..., cache_implementation="static")`` token for
        token (sampling: after ``torch.manual_seed`` with the generator's
        seed). Captures first if needed. Raises ``ValueError`` for bad shapes
        or when ``P + max_new_tokens - 1`` exceeds ``max_cache_len``.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError("input_ids must be a [batch, prompt_len] torch.long tensor")
        b, p = input_ids.shape
        if not 1 <= b <= self.max_batch or p < 1:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: need 1 <= batch <= max_batch="
                             f"{self.max_batch} and prompt_len >= 1")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if p + max(max_new_tokens - 1, 0) > self.max_cache_len:
            raise ValueError(f"prompt_len {p} + max_new_tokens {max_new_tokens} - 1 exceeds max_cache_len "
                             f"{self.max_cache_len}: build the DecodeRunner with a larger max_cache_len")
        mask = self._check_mask(attention_mask, input_ids)
        choose = TokenChooser(self.model, do_sample, temperature, top_k, top_p, generator)
        self.capture()
        dev = self.model.device
        input_ids = input_ids.to(dev)
        self.stats.generate_calls += 1
        if max_new_tokens == 0:
            return input_ids.clone()
        mask = None if mask is None else mask.to(dev)
        with torch.inference_mode():
            self._reset_cache()
            logits = self._prefill(input_ids, mask)
            eos, pad = self._eos_pad(dev)
            unfinished = torch.ones((b, 1), dtype=torch.bool, device=dev)
            full = torch.ones((b, p), dtype=torch.long, device=dev) if mask is None else mask
            positions = (full.long().cumsum(-1) - 1)[:, -1:]
            first = (full == 0).sum(-1, keepdim=True)
            out, token = input_ids, None
            for i in range(max_new_tokens):
                if i:
                    positions = positions + 1
                    slot = torch.full((b, 1), p + i - 1, dtype=torch.long, device=dev)
                    logits = self.runner(input_ids=token, position_ids=positions, cache_position=slot,
                                         first_slot=first)
                    self._count_step(b)
                token = choose(out, logits)
                if eos is not None:
                    # As model.generate: a finished row emits pad; all finished -> stop early.
                    token = torch.where(unfinished, token, pad)
                    unfinished &= ~torch.isin(token, eos)
                out = torch.cat([out, token], dim=1)
                self.stats.tokens += b
                if eos is not None and not bool(unfinished.any()):
                    break
        return out

    def _count_step(self, batch: int) -> None:
        bucket = self.runner.bucket_for(batch)
        if bucket is None:
            self.stats.eager_steps += 1
            return
        self.stats.replays += 1
        self.stats.per_bucket[bucket] = self.stats.per_bucket.get(bucket, 0) + 1

    def _check_mask(self, attention_mask: Optional[torch.Tensor], input_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """None for no mask or an all-ones one; else the mask, checked to be left padding with a real last token."""
        if attention_mask is None:
            return None
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must be a tensor of the prompt's shape {tuple(input_ids.shape)}")
        m = attention_mask.to(torch.long)
        if bool((m == 1).all()):
            return None
        if not bool(((m == 0) | (m == 1)).all()):
            raise ValueError("attention_mask must hold only 0 and 1")
        if bool((m[:, 1:] < m[:, :-1]).any()) or not bool((m[:, -1] == 1).all()):
            raise ValueError("attention_mask must be left padding: each row zeros then ones, ending in a real "
                             "token (pad prompts on the left, tokenizer.padding_side = 'left')")
        if not self.plan.explicit:
            raise ValueError(f"architecture {self.model_type!r} builds its attention masks itself "
                             f"({self.plan.reason}), so DecodeRunner supports only equal-length prompts for it: "
                             f"group prompts by length or use model.generate()")
        return m

    def _eos_pad(self, dev):
        """``(eos ids tensor or None, pad id tensor)`` from the model's generation config, as ``model.generate`` uses."""
        gc = getattr(self.model, "generation_config", None)
        eos = getattr(gc, "eos_token_id", None)
        if eos is None:
            return None, None
        eos_list = [eos] if isinstance(eos, int) else list(eos)
        if not eos_list:
            return None, None
        pad = getattr(gc, "pad_token_id", None)
        if pad is None:
            pad = eos_list[0]
        return (torch.tensor(eos_list, dtype=torch.long, device=dev),
                torch.tensor(pad, dtype=torch.long, device=dev))

    def cleanup(self) -> None:
        """Release the captured graphs (``GraphRunner.cleanup``); the runner cannot replay afterwards."""
        self.runner.cleanup()

    def __repr__(self) -> str:
        return (f"DecodeRunner(model_type={self.model_type!r}, max_batch={self.max_batch}, "
                f"max_cache_len={self.max_cache_len}, buckets={self.buckets}, captured={self._report is not None})")
