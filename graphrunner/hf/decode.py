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

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from graphrunner.buckets import default_buckets, validate_buckets
from graphrunner.devices import get_device
from graphrunner.errors import CaptureError, GraphRunnerError
from graphrunner.hf.cache import (
    cache_tensors,
    cache_was_written,
    layer_problem,
    make_static_cache,
    row_view_cache,
    widen_sliding_layers,
    zero_cache,
    zero_tensors,
)
from graphrunner.hf.masks import MaskPlan, plan_masks
from graphrunner.hf.selftest import SelfTestResult, run_self_test
from graphrunner.hf.steps import make_masked_step, masked_inputs, prefill
from graphrunner.progress import is_terminal
from graphrunner.runner import GraphRunner

if TYPE_CHECKING:
    from graphrunner.hf.generation import GenerationSetup
    from graphrunner.report import CaptureReport

#: The transformers major version whose cache layout DecodeRunner is written for.
VERIFIED_TRANSFORMERS_MAJOR = 5

#: ``config.model_type`` -> why :class:`DecodeRunner` refuses it although every check would pass:
#: problems that only show beyond the self-test's few steps or outside the decode step.
KNOWN_BAD: dict[str, str] = {
    "gpt_neo": (
        "its local-attention layers attend a window of config.window_size tokens that neither "
        "config.layer_types nor config.sliding_window describes, so the step's causal mask ignores it; "
        "within the window (the self-test's few steps) the tokens agree, past it they differ"
    ),
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
    self_test: SelfTestResult | None = None
    masks: str = ""
    per_bucket: dict[int, int] = field(default_factory=dict)


class DecodeRunner:
    """Decoding of a transformers causal LM whose one-token step replays as a captured graph.

    ``DecodeRunner(model, max_batch, max_cache_len, buckets=None, backend="full", device="auto", self_test=True,
    progress=True)`` builds a ``StaticCache`` of ``max_batch`` rows and ``max_cache_len``
    slots for ``model`` (an eval-mode ``*ForCausalLM`` on ``device``) and a
    :class:`GraphRunner` over the decode step with ``buckets`` (default:
    ``default_buckets(max_batch)``; the largest must be ``max_batch``).
    Nothing is captured until :meth:`capture` (or the first
    :meth:`generate`). ``self_test=False`` skips the capture self-test (the
    capture checks still run); only for models already verified.
    ``progress``: progress bars of the capture and the self-test on stderr
    when it is a terminal (never on a pipe or a log file); ``False`` turns
    them off.

    Limits, stated up front: one sequence per row (no beams), greedy or
    sampled with any of transformers' logits processors (see
    :meth:`generate`), prompts left-padded (``attention_mask``), the prompt
    prefilled eagerly and only the one-token decode step replayed. Raises
    ``ValueError`` for bad sizes and for a model in train mode.
    """

    def __init__(
        self,
        model,
        max_batch: int,
        max_cache_len: int,
        buckets: Sequence[int] | None = None,
        backend: Any = "full",
        device: Any = "auto",
        self_test: bool = True,
        progress: bool = True,
    ) -> None:
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if not isinstance(max_cache_len, int) or max_cache_len < 2:
            raise ValueError(f"max_cache_len must be an int >= 2 (prompt + new tokens), got {max_cache_len!r}")
        if buckets is None:
            buckets = default_buckets(max_batch)
        buckets = validate_buckets(buckets)  # GraphRunner's rules, checked before anything is built
        if buckets[-1] != max_batch:
            raise ValueError(
                f"the largest bucket must equal max_batch={max_batch}, got buckets {buckets}: "
                f"add {max_batch} or lower max_batch"
            )
        self.model = model
        self._check_eval()
        self.max_batch = max_batch
        self.max_cache_len = max_cache_len
        self.self_test = bool(self_test)
        self.progress = bool(progress) and is_terminal(sys.stderr)
        self.model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        self.device = get_device(device)
        self.cache = None
        self.plan = plan_masks(model.config)
        self._views: dict[int, Any] = {}
        self._report: CaptureReport | None = None
        self.stats = DecodeStats(masks="step" if self.plan.explicit else f"model ({self.plan.reason})")
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.vocab_size = getattr(emb, "num_embeddings", None) or getattr(model.config, "vocab_size", None)
        step = make_masked_step(model, self._view, lambda: self.plan, max_cache_len)
        self.runner = GraphRunner(
            step,
            inputs=masked_inputs(self.vocab_size, max_cache_len),
            buckets=buckets,
            backend=backend,
            device=self.device,
            progress=self.progress,
            fallback="error",
        )
        self.buckets: list[int] = list(self.runner.buckets)

    # ------------------------------------------------------------------ internals
    def _view(self, rows: int):
        if rows not in self._views:
            self._views[rows] = row_view_cache(self.cache, rows, self.max_batch)
        return self._views[rows]

    def _refuse(self, why: str) -> CaptureError:
        return CaptureError(f"gr.hf.DecodeRunner cannot capture architecture {self.model_type!r}: {why}")

    def _check_eval(self) -> None:
        """Refuse a model in train mode (``model.training``), naming it."""
        if getattr(self.model, "training", False):
            raise ValueError(
                f"gr.hf.DecodeRunner: the model ({type(self.model).__name__}) is in train() mode; "
                f"DecodeRunner decodes eval-mode models only (dropout would make each step random, "
                f"which neither a graph nor the capture checks can reproduce): call model.eval() first"
            )

    def _check_version(self) -> None:
        version = _transformers_version()
        head = version.split(".")[0]
        if not head.isdigit() or int(head) < VERIFIED_TRANSFORMERS_MAJOR:
            raise CaptureError(
                f"gr.hf.DecodeRunner is verified on transformers {VERIFIED_TRANSFORMERS_MAJOR}.x, found "
                f"{version}: older versions keep cache state in other objects "
                f"(e.g. MambaCache), which the graphs would not reset. Upgrade with "
                f"pip install 'graphrunner[hf]', or decode with model.generate()"
            )
        if self.model_type in KNOWN_BAD:
            raise self._refuse(f"{KNOWN_BAD[self.model_type]} (gr.hf.KNOWN_BAD); decode it with model.generate()")

    def _allocate(self) -> None:
        """Allocate the ``max_batch`` cache with one eager dummy token, check its layers, then zero it."""
        try:
            cache = self.cache = make_static_cache(self.model, self.max_batch, self.max_cache_len)
        except Exception as exc:  # transformers refuses configs it has no static cache for
            raise self._refuse(f"transformers cannot build a StaticCache for it ({type(exc).__name__}: {exc})") from exc
        if getattr(cache, "layers", None) is None:
            raise self._refuse(
                "this transformers version's StaticCache has no per-layer objects (transformers "
                ">= 4.56 needed for padded buckets); upgrade it"
            )
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
            raise self._refuse(
                "the StaticCache stayed empty after a forward: the model keeps no state in it "
                "(it ignores past_key_values), so a decode step would recompute nothing; decode "
                "it with model.generate()"
            ) from exc
        for i, layer in enumerate(cache.layers):
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
            self.plan = MaskPlan(
                "model", reason=f"its forward does not take 4D attention masks ({type(exc).__name__}: {str(exc)[:120]})"
            )
            self.stats.masks = f"model ({self.plan.reason})"

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill ``input_ids`` eagerly into rows ``[0, B)`` of the (emptied) cache; return the logits."""
        return prefill(self.model, self._view(input_ids.shape[0]), input_ids, attention_mask)

    def _reset_cache(self) -> None:
        """Empty the cache in place (the graphs keep the same tensors): after capture and the self-test, and
        before every :meth:`generate` (also clearing ``has_previous_state``, see :func:`zero_cache`)."""
        zero_cache(self.cache)

    # ------------------------------------------------------------------ API
    def capture(self) -> CaptureReport:
        """Capture the decode step for every bucket, run the self-test; return GraphRunner's ``CaptureReport``.

        Raises :class:`CaptureError` naming the architecture and the reason
        when the model cannot be captured safely: a capture check failed
        (state Python would freeze, padding leaking into real rows, an op a
        graph cannot hold), a cache layer a graph cannot keep in place, a
        model that ignores the cache, an entry of :data:`KNOWN_BAD`, or the
        self-test found replayed logits that differ from the model's own
        eager decode. The cache is emptied afterwards. The report's
        ``after_capture`` holds the self-test's time and result (its table
        prints them). Calling it again returns the first report. Raises
        ``ValueError`` for a model in train mode.
        """
        if self._report is not None:
            return self._report
        self._check_eval()
        self._check_version()
        with torch.inference_mode():
            self._allocate()
            try:
                report = self.runner.capture()
            except GraphRunnerError as exc:
                raise self._refuse(f"{exc}") from exc
            finally:
                self._reset_cache()
            if report is None:  # only a background capture returns no report; this one blocks
                raise GraphRunnerError("the decode step's capture returned no report")
            if self.self_test:
                t0 = time.perf_counter()
                try:
                    result = run_self_test(self, progress=self.progress)
                except CaptureError:
                    self.runner.cleanup()
                    raise
                self.stats.self_test = result
                report.after_capture.append(
                    {"name": "self-test", "seconds": time.perf_counter() - t0, "summary": result.summary()}
                )
        self._report = report
        return report

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: Any = None,
        logits_processor: Any = None,
        stopping_criteria: Any = None,
        prefix_allowed_tokens_fn: Any = None,
        synced_gpus: bool | None = None,
        assistant_model: Any = None,
        streamer: Any = None,
        negative_prompt_ids: torch.Tensor | None = None,
        negative_prompt_attention_mask: torch.Tensor | None = None,
        custom_generate: Any = None,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``model.generate`` with the decode step replayed: return ``[B, P + new]`` tokens (prompt, then new ones).

        Takes ``model.generate``'s arguments, with its meaning: ``inputs``
        (or ``input_ids=``) ``[B, P]`` long, ``1 <= B <= max_batch``;
        ``attention_mask`` ``[B, P]`` 0/1 for left padding (each row: zeros,
        then ones; ragged prompts need a model whose masks the step builds,
        ``stats.masks == "step"``); ``generation_config`` and any of its
        fields as keyword arguments, which override ``model.generation_config``
        as there (``max_new_tokens``, ``max_length``, ``min_new_tokens``,
        ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
        ``repetition_penalty``, ``no_repeat_ngram_size``, ``bad_words_ids``,
        ``suppress_tokens``, ``forced_eos_token_id``, ``pad_token_id``,
        ``eos_token_id`` (an int or a list), ``stop_strings`` with
        ``tokenizer=``, ...); ``logits_processor``, ``stopping_criteria``,
        ``prefix_allowed_tokens_fn`` and a ``streamer`` (``put``/``end``, e.g.
        ``transformers.TextStreamer``). Every default is resolved as
        ``model.generate`` resolves it (its global ``top_k=50`` and
        ``max_length=20`` included) and every logits processor and stopping
        criterion is transformers' own (:mod:`graphrunner.hf.generation`),
        applied outside the graph to each step's logits. ``generator``
        (not a ``model.generate`` argument) is the ``torch.Generator`` of the
        sampling draws (default: the global one).

        Equals ``model.generate(..., cache_implementation="static")`` token
        for token (sampling: with the generator at ``model.generate``'s
        ``torch.manual_seed``). A row that meets an EOS id continues with the
        pad id; decoding stops once every row has met a stopping criterion.
        Captures first if needed. Raises ``ValueError`` for bad shapes, when
        ``P + new - 1`` exceeds ``max_cache_len``, for a model in train mode,
        and for an argument it does not support (beams, assisted decoding,
        guidance, ``return_dict_in_generate``, a cache of the caller's, model
        keyword arguments other than ``attention_mask``, ...: named, with
        what to do); transformers' own errors for invalid values.
        """
        from graphrunner.hf.generation import refuse_arguments, resolve

        refuse_arguments(
            {
                "synced_gpus": synced_gpus,
                "assistant_model": assistant_model,
                "negative_prompt_ids": negative_prompt_ids,
                "negative_prompt_attention_mask": negative_prompt_attention_mask,
                "custom_generate": custom_generate,
            }
        )
        if generation_config is not None and not hasattr(generation_config, "to_dict"):
            raise TypeError(
                f"generate's second argument is generation_config, as in model.generate, got "
                f"{type(generation_config).__name__}: pass max_new_tokens= by keyword"
            )
        if "input_ids" in kwargs:
            if inputs is not None:
                raise ValueError("pass the prompt once: inputs or input_ids, not both")
            inputs = kwargs.pop("input_ids")
        input_ids = self._check_prompt(inputs)
        b, p = input_ids.shape
        self._check_eval()
        mask = self._check_mask(kwargs.pop("attention_mask", None), input_ids)
        dev = self.model.device
        input_ids = input_ids.to(dev)
        mask = None if mask is None else mask.to(dev)
        setup = resolve(
            self.model,
            input_ids,
            mask,
            generation_config,
            kwargs,
            logits_processor,
            stopping_criteria,
            prefix_allowed_tokens_fn,
        )
        new = setup.max_new_tokens
        if p + new - 1 > self.max_cache_len:
            raise ValueError(
                f"prompt_len {p} + {new} new tokens - 1 exceeds max_cache_len {self.max_cache_len} "
                f"(max_length {setup.config.max_length}): build the DecodeRunner with a larger "
                f"max_cache_len, or pass a smaller max_new_tokens"
            )
        self.capture()
        self.stats.generate_calls += 1
        with torch.inference_mode():
            return self._decode(input_ids, mask, setup, streamer, generator)

    def _check_prompt(self, input_ids: Any) -> torch.Tensor:
        """``input_ids`` checked: a ``[B, P]`` long tensor, ``1 <= B <= max_batch``, ``P >= 1``."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError("input_ids must be a [batch, prompt_len] torch.long tensor")
        b, p = input_ids.shape
        if b > self.max_batch:
            raise ValueError(
                f"input_ids has {b} rows (shape {tuple(input_ids.shape)}), more than this DecodeRunner's "
                f"max_batch={self.max_batch} (its static cache and largest graph hold {self.max_batch} rows): "
                f"build it with DecodeRunner(model, max_batch={b}, ...) (or larger), or call generate on at "
                f"most {self.max_batch} rows at a time (input_ids[:{self.max_batch}], then the rest)"
            )
        if b < 1 or p < 1:
            raise ValueError(
                f"input_ids has shape {tuple(input_ids.shape)}: generate needs at least one row and "
                "a prompt of at least one token ([batch >= 1, prompt_len >= 1])"
            )
        return input_ids

    def _decode(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None,
        setup: GenerationSetup,
        streamer: Any,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        """Prefill ``input_ids`` eagerly, then decode up to ``setup.max_new_tokens`` tokens through the graphs."""
        b, p = input_ids.shape
        dev = input_ids.device
        self._reset_cache()
        if streamer is not None:
            streamer.put(input_ids.cpu())
        logits = self._prefill(input_ids, mask)
        unfinished = torch.ones(b, dtype=torch.long, device=dev)
        full = torch.ones((b, p), dtype=torch.long, device=dev) if mask is None else mask
        positions = (full.long().cumsum(-1) - 1)[:, -1:]
        first = (full == 0).sum(-1, keepdim=True)
        out = input_ids
        for i in range(setup.max_new_tokens):
            if i:
                positions = positions + 1
                slot = torch.full((b, 1), p + i - 1, dtype=torch.long, device=dev)
                logits = self.runner(
                    input_ids=out[:, -1:], position_ids=positions, cache_position=slot, first_slot=first
                )
                self._count_step(b)
            token = setup.next_tokens(out, logits, generator)
            if setup.pad_finished and setup.pad is not None:  # resolve() refuses a criterion without a pad
                token = token * unfinished + setup.pad * (1 - unfinished)  # as model.generate: pad finished rows
            out = torch.cat([out, token[:, None]], dim=-1)
            self.stats.tokens += b
            unfinished = unfinished & ~setup.criteria(out, None)
            if streamer is not None:
                streamer.put(token.cpu())
            if bool(unfinished.max() == 0):
                break
        if streamer is not None:
            streamer.end()
        return out

    def _count_step(self, batch: int) -> None:
        bucket = self.runner.bucket_for(batch)
        if bucket is None:
            self.stats.eager_steps += 1
            return
        self.stats.replays += 1
        self.stats.per_bucket[bucket] = self.stats.per_bucket.get(bucket, 0) + 1

    def _check_mask(self, attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
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
            raise ValueError(
                "attention_mask must be left padding: each row zeros then ones, ending in a real "
                "token (pad prompts on the left, tokenizer.padding_side = 'left')"
            )
        if not self.plan.explicit:
            raise ValueError(
                f"architecture {self.model_type!r} builds its attention masks itself "
                f"({self.plan.reason}), so DecodeRunner supports only equal-length prompts for it: "
                f"group prompts by length or use model.generate()"
            )
        return m

    def cleanup(self) -> None:
        """Release the captured graphs (``GraphRunner.cleanup``); the runner cannot replay afterwards."""
        self.runner.cleanup()

    def __repr__(self) -> str:
        return (
            f"DecodeRunner(model_type={self.model_type!r}, max_batch={self.max_batch}, "
            f"max_cache_len={self.max_cache_len}, buckets={self.buckets}, captured={self._report is not None})"
        )
