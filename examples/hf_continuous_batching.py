"""transformers' continuous batching (``model.generate_batch``) with its step replayed from graphrunner graphs.

A small Llama is built from a config with random weights (nothing is downloaded).
``gr.hf.generate_batch`` runs the same prompts through transformers' own engine
(scheduler, paged cache, sampler) with the forward of every step served by a
``GraphRunner``; the tokens must equal ``model.generate_batch`` token for token.

Run it::

    pip install -e '.[hf]'
    python examples/hf_continuous_batching.py --requests 24 --new 8

It prints the graphs captured, the padding and both timings, and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

__all__ = ["build_model", "prompts", "run", "main"]


def build_model(seed: int = 0):
    """A ``LlamaForCausalLM`` (hidden 64, 2 layers, vocab 128, sdpa attention) with random weights from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def prompts(n: int, seed: int = 1, longest: int = 48) -> list[list[int]]:
    """``n`` seeded prompts of 1..``longest`` token ids (3..127)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 128, (int(k),), generator=g).tolist() for k in torch.randint(1, longest + 1, (n,), generator=g)
    ]


def run(requests: int = 24, new: int = 8, device: str = "auto") -> dict[str, Any]:
    """Generate with transformers' eager engine and with graphs; return the counts, timings and mismatches."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import graphrunner as gr
    import graphrunner.hf  # noqa: F401  (gr.hf needs the hf extra)

    model, inputs = build_model(), prompts(requests)
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)

    def engine():  # a cache sized for the example (transformers sizes it from free memory otherwise)
        return ContinuousBatchingConfig(page_size=16, num_blocks=128, max_batch_tokens=64, max_requests_per_batch=16)

    t = time.perf_counter()
    eager = model.generate_batch(inputs=inputs, generation_config=gen, continuous_batching_config=engine())
    eager_s = time.perf_counter() - t
    info: dict[str, Any] = {}
    t = time.perf_counter()
    graphed = gr.hf.generate_batch(model, inputs, gen, engine(), device=device, stats=info)
    graph_s = time.perf_counter() - t
    stats = info["stats"]
    mismatches = [k for k in eager if eager[k].generated_tokens != graphed[k].generated_tokens]
    return {
        "requests": len(graphed),
        "tokens": sum(len(o.generated_tokens) for o in graphed.values()),
        "graphs": stats.graphs,
        "steps": stats.steps,
        "replayed": stats.replayed,
        "eager_steps": stats.eager_steps,
        "padded_tokens": stats.padded_tokens,
        "real_tokens": stats.real_tokens,
        "capture_s": stats.capture_seconds,
        "dry_run_s": stats.dry_run_seconds,
        "eager_s": eager_s,
        "graph_s": graph_s,
        "mismatches": mismatches,
    }


def main(argv=None) -> int:
    """Command line: print a summary; exit 1 when a request's tokens differ from ``model.generate_batch``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--new", type=int, default=8, help="new tokens per request")
    p.add_argument("--device", default="auto", help="auto | tape | cuda")
    args = p.parse_args(argv)
    if args.requests < 1 or args.new < 1:
        p.error("--requests and --new must be >= 1")
    r = run(args.requests, args.new, args.device)
    share = r["padded_tokens"] / max(1, r["padded_tokens"] + r["real_tokens"])
    print(
        f"{r['requests']} requests, {r['tokens']} tokens: {r['graphs']} graphs captured in {r['capture_s']:.1f} s "
        f"(dry run {r['dry_run_s']:.1f} s); {r['replayed']}/{r['steps']} steps replayed, {r['eager_steps']} eager, "
        f"{share:.1%} padding tokens"
    )
    print(
        f"model.generate_batch {r['eager_s']:.2f} s, gr.hf.generate_batch {r['graph_s']:.2f} s (capture included); "
        f"mismatching requests: {len(r['mismatches'])}"
    )
    return 1 if r["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
