"""The tiny chat model ``graphrunner serve`` serves when no model is given: :func:`tiny_model_dir`.

A transformers Llama with random (seeded) weights and a character tokenizer with a chat template, built
locally (nothing downloaded) and saved once as a model directory any transformers loader reads. Its
answers are gibberish but deterministic, so servers can be compared answer for answer (the serve tests,
``bench/serve_sweep.py``). Needs transformers and tokenizers (the ``serve`` extra).
"""

from __future__ import annotations

import os

__all__ = ["tiny_model_dir"]


def tiny_model_dir(folder: str | None = None) -> str:
    """A directory holding the built-in tiny chat model, made once (random weights, seeded; a
    character tokenizer with a chat template, built locally; nothing downloaded): a Llama of 2
    layers, hidden 64, 99 tokens (the 95 printable ASCII characters, newline, ``<|im_start|>``,
    ``<|im_end|>``, ``<|pad|>``), 2048 positions. ``folder``: where (default ``$GRAPHRUNNER_CACHE`` or ``~/.cache/graphrunner``,
    then ``tiny-chat-3``); an existing complete one is reused."""
    root = folder or os.path.join(
        os.environ.get("GRAPHRUNNER_CACHE") or os.path.expanduser("~/.cache/graphrunner"), "tiny-chat-3"
    )
    done = os.path.join(root, ".complete")
    if os.path.exists(done):
        return root
    import tempfile

    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-chat-", dir=os.path.dirname(os.path.abspath(root)))
    chars = [chr(c) for c in range(32, 127)] + ["\n"]  # printable: any token sequence decodes to text and back
    specials = ["<|im_start|>", "<|im_end|>", "<|pad|>"]
    tok = Tokenizer(models.WordLevel(vocab={ch: i for i, ch in enumerate(chars)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token a character
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|pad|>"
    )
    fast.chat_template = template
    fast.save_pretrained(tmp)
    eos, pad = fast.convert_tokens_to_ids("<|im_end|>"), fast.convert_tokens_to_ids("<|pad|>")
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=fast.bos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )  # untied, wide: greedy answers vary with the prompt
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=False)
    model.save_pretrained(tmp)
    with open(os.path.join(tmp, ".complete"), "w") as f:
        f.write("graphrunner tiny chat model\n")
    try:
        os.replace(tmp, root)
    except OSError:  # another process made it first: use theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return root
