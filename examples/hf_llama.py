"""Greedy decoding of a Hugging Face ``LlamaForCausalLM`` through ``gr.hf.DecodeRunner``.

A small Llama is built from a config with random weights (nothing is
downloaded). :class:`graphrunner.hf.DecodeRunner` captures its one-token
decode step on an empty ``StaticCache`` (see ``graphrunner/hf.py`` for why the
cache is reset in place after capture), then generates ``--steps`` tokens;
they must equal ``model.generate(..., do_sample=False,
cache_implementation="static")`` token for token.

Run it::

    pip install -e '.[hf]'
    python examples/hf_llama.py --steps 20 --batch 1 --backend breakable

It prints a short summary and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

import graphrunner as gr

__all__ = ["DEFAULT_CONFIG", "DecodeResult", "build_model", "run", "main"]

#: Small model shape: a 20-token generation runs in well under a second on 2 CPU cores.
DEFAULT_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def build_model(seed: int = 0, device: Any = "cpu", attn_implementation: str = "sdpa", **config_overrides: Any):
    """Return a ``LlamaForCausalLM`` in eval mode with random weights drawn from ``seed``.

    The config is :data:`DEFAULT_CONFIG` updated with ``config_overrides``;
    nothing is downloaded. ``attn_implementation`` is ``"sdpa"`` or ``"eager"``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**DEFAULT_CONFIG, **config_overrides})
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(device).eval()


@dataclass
class DecodeResult:
    """Outcome of :func:`run`: ``got`` (DecodeRunner) and ``want`` (``model.generate``) token tensors and timings (ms).

    ``replays`` counts decode steps served by a graph replay; ``report`` is
    the capture report (``num_segments``/``num_breaks`` of the one bucket).
    """

    steps: int
    batch: int
    backend: str
    got: torch.Tensor
    want: torch.Tensor
    capture_ms: float
    generate_ms: float
    reference_ms: float
    replays: int
    num_segments: int
    num_breaks: int
    report: Any = None

    @property
    def ok(self) -> bool:
        """True when DecodeRunner's tokens equal ``model.generate``'s."""
        return torch.equal(self.got, self.want)

    def summary(self) -> str:
        """A few human-readable lines."""
        status = "OK: tokens equal model.generate" if self.ok else "MISMATCH: tokens differ from model.generate"
        return "\n".join(
            [
                f"hf llama decode | backend={self.backend} batch={self.batch} steps={self.steps} | "
                f"{self.num_segments} segment(s), {self.num_breaks} break(s), {self.replays} replays",
                f"  {status}",
                f"  capture {self.capture_ms:.1f} ms | DecodeRunner.generate {self.generate_ms:.1f} ms, "
                f"model.generate {self.reference_ms:.1f} ms",
            ]
        )


def run(
    steps: int = 20,
    batch: int = 1,
    backend: str = "breakable",
    device: Any = "auto",
    seed: int = 0,
    prompt_len: int = 6,
    restore_after_capture: bool = True,
    **config_overrides: Any,
) -> DecodeResult:
    """Generate ``steps`` tokens for ``batch`` random prompts with DecodeRunner and with ``model.generate``.

    ``restore_after_capture=False`` turns the runner's in-place cache reset
    into a no-op and its capture self-test off (a negative control: the
    capture warmups' writes must then show up as different tokens; with the
    self-test on, capture itself would refuse). Never raises on a mismatch.
    """
    if steps < 1 or batch < 1 or prompt_len < 1:
        raise ValueError(f"steps, batch and prompt_len must be >= 1, got {steps}, {batch}, {prompt_len}")
    dev = gr.get_device(device)
    model = build_model(seed, device=dev.torch_device, **config_overrides)
    runner = gr.hf.DecodeRunner(
        model,
        max_batch=batch,
        max_cache_len=prompt_len + steps,
        buckets=[batch],
        backend=backend,
        device=dev,
        self_test=restore_after_capture,
    )
    if not restore_after_capture:
        runner._reset_cache = lambda: None
    t0 = time.perf_counter()
    report = runner.capture()
    t1 = time.perf_counter()
    # Ids >= 3: no bos/eos/pad in the prompt.
    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=gen).to(dev.torch_device)
    got = runner.generate(prompt, max_new_tokens=steps)
    t2 = time.perf_counter()
    with torch.inference_mode():
        want = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=steps,
            do_sample=False,
            cache_implementation="static",
        )
    t3 = time.perf_counter()
    result = DecodeResult(
        steps=steps,
        batch=batch,
        backend=backend,
        got=got,
        want=want,
        capture_ms=(t1 - t0) * 1e3,
        generate_ms=(t2 - t1) * 1e3,
        reference_ms=(t3 - t2) * 1e3,
        replays=runner.stats.replays,
        num_segments=report.bucket(batch).num_segments,
        num_breaks=report.bucket(batch).num_breaks,
        report=report,
    )
    runner.cleanup()
    return result


def main(argv: list[str] | None = None) -> int:
    """Command line: run :func:`run` and print its summary; return 0 when the tokens match, else 1."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--backend", default="breakable", choices=["breakable", "full", "eager"])
    p.add_argument("--device", default="auto", choices=["auto", "tape", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=DEFAULT_CONFIG["num_hidden_layers"])
    p.add_argument("--hidden", type=int, default=DEFAULT_CONFIG["hidden_size"])
    args = p.parse_args(argv)
    result = run(
        steps=args.steps,
        batch=args.batch,
        backend=args.backend,
        device=args.device,
        seed=args.seed,
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
    )
    print(result.summary())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
