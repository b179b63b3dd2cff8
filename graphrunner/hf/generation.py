"""A ``generate`` call's arguments, resolved by transformers' own code exactly as ``model.generate`` resolves them.

:func:`resolve` takes what :meth:`~graphrunner.hf.DecodeRunner.generate`
was given (a ``generation_config``, keyword arguments such as
``max_new_tokens``, ``repetition_penalty``, ``eos_token_id``, custom
``logits_processor``/``stopping_criteria`` lists, ...) and returns a
:class:`GenerationSetup`: the merged generation config, the logits
processors, the stopping criteria, the pad id and the number of new tokens.
Every step is the one ``model.generate`` runs (``GenerationMixin`` in
transformers 5.x), called on the model itself, so the precedence
(arguments > ``generation_config`` > ``model.generation_config`` >
transformers' global defaults such as ``top_k=50``), the validation and the
processors' classes, order and parameters are transformers' own:

``_prepare_generation_config``, ``_prepare_special_tokens``,
``_prepare_generated_length``, ``_validate_generated_length``,
``_get_logits_processor``, ``_get_stopping_criteria``.

These are private methods of ``GenerationMixin``; :data:`~graphrunner.hf.decode.VERIFIED_TRANSFORMERS_MAJOR`
is the major version they are verified on, and a version without one of them
is refused with the method's name. Anything ``model.generate`` accepts that
the graph-replayed loop cannot do the same way (beams, assisted decoding,
classifier-free guidance, scores and hidden states in a dict, a cache of the
caller's, model keyword arguments other than ``attention_mask``) is refused
by name with what to do (:data:`REFUSED_ARGUMENTS`, :data:`MODES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GenerationSetup", "resolve", "REFUSED_ARGUMENTS", "MODES"]

#: ``model.generate`` arguments (named ones and generation-config fields) that ``DecodeRunner.generate``
#: refuses when set to anything but their neutral value -> (neutral values, what to do instead).
REFUSED_ARGUMENTS: dict[str, Any] = {
    "synced_gpus": ((None, False), "one process decodes here; decode with model.generate under FSDP/ZeRO-3"),
    "assistant_model": (
        (None,),
        "assisted decoding runs a second model between the graph's steps; decode with model.generate",
    ),
    "assistant_tokenizer": ((None,), "assisted decoding is not supported; decode with model.generate"),
    "negative_prompt_ids": (
        (None,),
        "classifier-free guidance runs a second, unconditional forward per step outside "
        "the graphs; decode with model.generate",
    ),
    "negative_prompt_attention_mask": (
        (None,),
        "classifier-free guidance is not supported; decode with model.generate",
    ),
    "custom_generate": ((None,), "a custom decoding loop replaces DecodeRunner's; decode with model.generate"),
    "guidance_scale": (
        (None, 1, 1.0),
        "classifier-free guidance runs a second, unconditional forward per step "
        "outside the graphs; decode with model.generate",
    ),
    "num_return_sequences": (
        (None, 1),
        "repeat each prompt row instead (input_ids.repeat_interleave(n, dim=0), the attention_mask too) and sample",
    ),
    "return_dict_in_generate": (
        (None, False),
        "DecodeRunner.generate returns the token tensor only; decode with "
        "model.generate for scores, logits, attentions or hidden states",
    ),
    "output_scores": ((None, False), "DecodeRunner.generate returns the token tensor only"),
    "output_logits": ((None, False), "DecodeRunner.generate returns the token tensor only"),
    "output_attentions": ((None, False), "the captured step returns logits only"),
    "output_hidden_states": ((None, False), "the captured step returns logits only"),
    "use_cache": ((None, True), "DecodeRunner always decodes through its StaticCache; drop use_cache=False"),
    "cache_implementation": (
        (None, "static"),
        "DecodeRunner always decodes through its own StaticCache (its tokens "
        "equal cache_implementation='static'); drop the argument",
    ),
    "token_healing": ((None, False), "token healing rewrites the prompt with a tokenizer; decode with model.generate"),
}

#: generation modes (``GenerationConfig.get_generation_mode``) -> what to do; greedy and sample are supported.
MODES: dict[str, str] = {
    "beam_search": "DecodeRunner decodes one sequence per row: pass num_beams=1, or decode with model.generate",
    "beam_sample": "DecodeRunner decodes one sequence per row: pass num_beams=1, or decode with model.generate",
    "group_beam_search": "pass num_beams=1 and num_beam_groups=1, or decode with model.generate",
    "constrained_beam_search": "constraints/force_words_ids need beam search; decode with model.generate",
    "contrastive_search": "contrastive search (penalty_alpha) re-ranks candidates with extra forwards: pass "
    "penalty_alpha=None, or decode with model.generate",
    "assisted_generation": "assisted decoding (assistant_model, prompt_lookup_num_tokens, ...) is not supported; "
    "decode with model.generate",
    "dola_generation": "DoLa (dola_layers) needs every layer's hidden states; decode with model.generate",
}

#: refused only when passed to generate: a model's generation_config may name its cache, which changes no token
CONFIG_IGNORED = ("cache_implementation", "use_cache")

#: the model keyword arguments DecodeRunner.generate takes (model.generate passes the others to the forward)
MODEL_KWARGS = ("attention_mask",)

#: GenerationMixin's methods resolve() calls, in order
PRIVATE_METHODS = (
    "_prepare_generation_config",
    "_prepare_special_tokens",
    "_prepare_generated_length",
    "_validate_generated_length",
    "_get_logits_processor",
    "_get_stopping_criteria",
)


@dataclass
class GenerationSetup:
    """What ``model.generate`` would decode with, for one call.

    ``config``: the merged ``GenerationConfig`` (a copy; ``_eos_token_tensor``
    and ``_pad_token_tensor`` set); ``processors``: the ``LogitsProcessorList``
    applied to each step's float32 last-position logits, warpers included when
    sampling; ``criteria``: the ``StoppingCriteriaList`` (max length, EOS,
    stop strings, max time, the caller's); ``do_sample``; ``max_new_tokens``:
    the most new tokens the call can produce (``config.max_length`` minus
    the prompt); ``pad``: the id finished rows continue with (a 0-dim long
    tensor, or None) and ``pad_finished``: whether they do (a criterion
    watches EOS ids, as ``model.generate`` decides it).
    """

    config: Any
    processors: Any
    criteria: Any
    do_sample: bool
    max_new_tokens: int
    pad: torch.Tensor | None
    pad_finished: bool

    def next_tokens(
        self, tokens: torch.Tensor, logits: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """The next token of each row, ``[B]`` long: ``logits`` ``[B, T, V]`` (last position, float32) through the
        processors (``tokens`` ``[B, S]``: every token so far), then ``argmax`` or one ``torch.multinomial``
        draw from ``generator`` (the default generator when None), as ``model.generate``'s loop chooses them."""
        scores = self.processors(tokens, logits[:, -1].to(copy=True, dtype=torch.float32))
        if not self.do_sample:
            return torch.argmax(scores, dim=-1)
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def _neutral(value: Any, neutrals: tuple) -> bool:
    """True when ``value`` is one of ``neutrals`` (``None`` compared by identity: a tensor is never neutral)."""
    return any(value is n or (n is not None and not isinstance(value, torch.Tensor) and value == n) for n in neutrals)


def _where(name: str, given: dict[str, Any], base: Any) -> str:
    if name in given:
        return "passed to generate"
    if base is not None and getattr(base, name, None) is not None:
        return "from the generation_config passed to generate"
    return "from the model's generation_config"


def refuse_arguments(named: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first of ``model.generate``'s named arguments in ``named`` that
    :data:`REFUSED_ARGUMENTS` refuses at a non-neutral value."""
    for name, value in named.items():
        neutrals, todo = REFUSED_ARGUMENTS[name]
        if not _neutral(value, neutrals):
            raise ValueError(
                f"gr.hf.DecodeRunner.generate does not support {name}={_short(value)} (passed to generate): {todo}"
            )


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor of shape {list(value.shape)}>"
    text = repr(value)
    return text if len(text) <= 60 else f"<{type(value).__name__}>"


def _private(model: Any, name: str) -> Any:
    fn = getattr(model, name, None)
    if fn is None:
        import transformers

        raise TypeError(
            f"gr.hf.DecodeRunner.generate resolves generation arguments with transformers' own "
            f"GenerationMixin.{name}, which this transformers ({transformers.__version__}) or this "
            f"model ({type(model).__name__}) does not have: use transformers 5.x and a model with "
            f"a generation head, or decode with model.generate()"
        )
    return fn


def resolve(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    generation_config: Any = None,
    kwargs: dict[str, Any] | None = None,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    prefix_allowed_tokens_fn: Any = None,
) -> GenerationSetup:
    """Resolve one call's generation arguments as ``model.generate`` does; return the :class:`GenerationSetup`.

    ``input_ids`` ``[B, P]`` (on the model's device); ``attention_mask``
    ``[B, P]`` or None (all ones); ``kwargs``: the call's keyword arguments
    (generation-config fields, ``tokenizer`` for ``stop_strings``; model
    keyword arguments other than ``attention_mask`` are refused). Raises
    ``ValueError`` for an argument or a generation mode DecodeRunner does not
    support (named, with what to do) and whatever transformers raises for
    invalid values (``temperature=0.0`` when sampling, ``max_new_tokens=0``, ...).
    """
    from transformers import LogitsProcessorList, StoppingCriteriaList

    kwargs = dict(kwargs or {})
    tokenizer = kwargs.pop("tokenizer", None)
    kwargs.pop("trust_remote_code", None)
    refuse_arguments({k: kwargs.get(k) for k in REFUSED_ARGUMENTS if k in kwargs})
    # As model.generate: were max_length / min_length left to the defaults? (decided before the merge)
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    has_default_min_length = (
        kwargs.get("min_length") is None
        and (generation_config is None or generation_config.min_length is None)
        and model.generation_config.min_length is None
    )
    config, model_kwargs = _private(model, "_prepare_generation_config")(generation_config, **kwargs)
    for name in model_kwargs:
        if name not in MODEL_KWARGS and name not in ("output_attentions", "output_hidden_states"):
            raise ValueError(
                f"gr.hf.DecodeRunner.generate does not take {name}=: it is no generation_config field, "
                f"so model.generate would pass it to the model's forward, and the captured step takes "
                f"only input_ids and attention_mask (check the spelling, or decode with "
                f"model.generate)"
            )
    for name, (neutrals, todo) in REFUSED_ARGUMENTS.items():  # also those a generation_config sets
        value = getattr(config, name, None)
        if name in CONFIG_IGNORED and name not in kwargs:
            continue
        if hasattr(config, name) and not _neutral(value, neutrals):
            raise ValueError(
                f"gr.hf.DecodeRunner.generate does not support {name}={_short(value)} "
                f"({_where(name, kwargs, generation_config)}): {todo}"
            )
    mode = str(getattr(config.get_generation_mode(), "value", config.get_generation_mode()))
    if mode not in ("greedy_search", "sample"):
        set_fields = [
            f"{k}={getattr(config, k)!r}"
            for k in (
                "num_beams",
                "num_beam_groups",
                "penalty_alpha",
                "constraints",
                "force_words_ids",
                "dola_layers",
                "prompt_lookup_num_tokens",
                "use_mtp",
                "assistant_early_exit",
            )
            if getattr(config, k, None) not in (None, 1, False)
        ]
        raise ValueError(
            f"gr.hf.DecodeRunner.generate decodes greedily or by sampling; these arguments ask "
            f"model.generate for {mode} ({', '.join(set_fields) or 'see generation_config'}): "
            f"{MODES.get(mode, 'decode with model.generate')}"
        )
    b, p = input_ids.shape
    dev = input_ids.device
    _private(model, "_prepare_special_tokens")(config, None, device=dev, batch_size=b)
    config = _private(model, "_prepare_generated_length")(
        generation_config=config,
        has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length,
        model_input_name="input_ids",
        input_ids_length=p,
        inputs_tensor=input_ids,
    )
    _private(model, "_validate_generated_length")(config, p, has_default_max_length)
    processors = _private(model, "_get_logits_processor")(
        generation_config=config,
        input_ids_seq_length=p,
        encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
        device=dev,
        model_kwargs={"attention_mask": attention_mask},
    )
    criteria = _private(model, "_get_stopping_criteria")(
        generation_config=config,
        stopping_criteria=stopping_criteria if stopping_criteria is not None else StoppingCriteriaList(),
        tokenizer=tokenizer,
    )
    pad = config._pad_token_tensor
    if pad is None and any(hasattr(c, "eos_token_id") for c in criteria):
        # finished rows continue with the pad id (as model.generate, which fails mid-decode on a None one)
        raise ValueError(
            "gr.hf.DecodeRunner.generate: a stopping criterion watches eos_token_id but there is no "
            "pad_token_id (nor an eos_token_id in the generation config to pad with) for the rows "
            "that finish first: pass pad_token_id="
        )
    return GenerationSetup(
        config=config,
        processors=processors,
        criteria=criteria,
        do_sample=mode == "sample",
        max_new_tokens=int(config.max_length) - p,
        pad=None if pad is None else pad.to(dev),
        pad_finished=any(hasattr(c, "eos_token_id") for c in criteria),
    )


def processor_names(setup: GenerationSetup) -> list[str]:
    """The class names of ``setup``'s logits processors, in the order they apply."""
    return [type(p).__name__ for p in setup.processors]
