"""Capture a Hugging Face ``LlamaForCausalLM`` decode step with a ``StaticCache`` through GraphRunner.

A small Llama is built from a config with random weights (nothing is downloaded),
prefilled eagerly, and its one-token decode step is captured with
:class:`graphrunner.GraphRunner`. An eager twin (same weights, its own
``StaticCache``) steps the same tokens; after every step the replayed logits and
every tensor of the graph's cache (keys, values and, on recent ``transformers``,
the per-layer write counter) must equal the twin's bit for bit.

Run it::

    pip install -e '.[hf]'
    python examples/hf_llama.py --steps 20 --batch 1 --backend breakable

It prints a short summary and exits 1 on any mismatch.

Why the cache is snapshotted around capture: the capture protocol runs the
step eagerly ``warmups`` times before capturing, and those warmups really
write the cache (a ``StaticCache`` writes key/value rows with ``index_copy_``
and, on ``transformers`` 5.x, advances a per-layer ``cumulative_length``
counter in place). The tape capture itself undoes its own writes to external
tensors, as a CUDA capture launches nothing, but warmups are real steps.
:func:`run` therefore snapshots the cache before ``runner.capture()`` and
restores it *in place* afterwards (in place, so the graph keeps the same
tensors), which leaves it exactly as the eager twin's.

Version notes: ``transformers`` 5.x passes the cache as ``cache=`` and keeps
the write position in the cache; 4.x passes ``past_key_values=`` and takes a
``cache_position`` tensor, which the step derives from ``position_ids`` (all
rows of a batch decode at the same position here). The ``StaticCache``
constructor is called with whichever of ``max_batch_size``/``batch_size``,
``device`` and ``dtype`` its signature accepts.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

import graphrunner as gr
from graphrunner.runner import BatchInput, GraphRunner

__all__ = [
    "DecodeResult",
    "build_model",
    "make_static_cache",
    "cache_tensors",
    "snapshot_cache",
    "restore_cache",
    "compare_caches",
    "prefill",
    "make_decode_step",
    "decode_inputs",
    "run",
    "main",
]

#: Small model shape: a 20-step comparison runs in well under a second on 2 CPU cores.
DEFAULT_CONFIG: Dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def build_model(seed: int = 0, device: "str | torch.device" = "cpu", attn_implementation: str = "sdpa",
                **config_overrides: Any):
    """Return a ``LlamaForCausalLM`` in eval mode with random weights drawn from ``seed``.

    The config is :data:`DEFAULT_CONFIG` updated with ``config_overrides``;
    nothing is downloaded. ``attn_implementation`` is ``"sdpa"`` or ``"eager"``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**DEFAULT_CONFIG, **config_overrides})
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    return model.to(device).eval()


def make_static_cache(model, batch_size: int, max_cache_len: int):
    """Return a ``transformers.StaticCache`` for ``model`` holding ``batch_size`` rows of ``max_cache_len`` tokens.

    Works across the constructor signatures of ``transformers`` 4.45 to 5.x:
    ``config`` and ``max_cache_len`` are always passed; ``max_batch_size`` (or
    ``batch_size``), ``device`` and ``dtype`` only where the signature names
    them. On versions that allocate lazily, the tensors appear at the first
    write (the eager prefill), never inside a capture.
    """
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kwargs: Dict[str, Any] = {"config": model.config, "max_cache_len": max_cache_len}
    if "max_batch_size" in params:
        kwargs["max_batch_size"] = batch_size
    elif "batch_size" in params:
        kwargs["batch_size"] = batch_size
    if "device" in params:
        kwargs["device"] = model.device
    if "dtype" in params:
        kwargs["dtype"] = model.dtype
    return StaticCache(**kwargs)


def cache_tensors(cache) -> Dict[str, torch.Tensor]:
    """Return every tensor a ``StaticCache`` holds, by a readable name.

    On ``transformers`` >= 4.56 these are the tensor attributes of each layer
    in ``cache.layers`` (``keys``, ``values`` and, on 5.x, the write counter
    ``cumulative_length``); on older versions the ``key_cache`` and
    ``value_cache`` lists. Raises ``ValueError`` if the cache holds none
    (not yet allocated: prefill it first).
    """
    out: Dict[str, torch.Tensor] = {}
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for i, layer in enumerate(layers):
            for name, value in sorted(vars(layer).items()):
                if isinstance(value, torch.Tensor):
                    out[f"layers[{i}].{name}"] = value
    else:
        for attr in ("key_cache", "value_cache"):
            for i, value in enumerate(getattr(cache, attr, None) or []):
                if isinstance(value, torch.Tensor):
                    out[f"{attr}[{i}]"] = value
    if not out:
        raise ValueError("the StaticCache holds no tensors yet: prefill it before capturing or comparing")
    return out


def snapshot_cache(cache) -> Dict[str, torch.Tensor]:
    """Return clones of every cache tensor (see :func:`cache_tensors`)."""
    return {name: t.clone() for name, t in cache_tensors(cache).items()}


def restore_cache(cache, snapshot: Dict[str, torch.Tensor]) -> None:
    """Copy ``snapshot`` back into the cache tensors *in place*.

    In place matters: a captured graph holds the cache tensors themselves;
    replacing them (``layer.keys = saved``) would leave the graph writing
    tensors the model no longer reads. Call under the same grad mode the
    cache was made in (``torch.inference_mode()`` here).
    """
    current = cache_tensors(cache)
    if current.keys() != snapshot.keys():
        raise ValueError(f"snapshot names {sorted(snapshot)} do not match the cache's {sorted(current)}")
    for name, t in current.items():
        t.copy_(snapshot[name])


def compare_caches(got, want) -> List[str]:
    """Return one line per cache tensor of ``got`` that is not ``torch.equal`` to ``want``'s (empty: equal)."""
    g, w = cache_tensors(got), cache_tensors(want)
    if g.keys() != w.keys():
        return [f"cache tensor names differ: {sorted(g)} vs {sorted(w)}"]
    bad = []
    for name in g:
        if not torch.equal(g[name], w[name]):
            diff = (g[name].double() - w[name].double()).abs().max().item() if g[name].shape == w[name].shape else "shape"
            bad.append(f"{name}: max abs diff {diff}")
    return bad


def _forward_kwargs(model) -> Dict[str, str]:
    params = inspect.signature(model.forward).parameters
    return {
        "cache": "cache" if "cache" in params else "past_key_values",
        "cache_position": "cache_position" in params,
    }


def prefill(model, cache, input_ids: torch.Tensor) -> torch.Tensor:
    """Run the prompt ``input_ids`` ``[B, P]`` eagerly through ``model``, writing ``cache``; return logits ``[B, P, V]``.

    Every row is at positions ``0..P-1`` (equal-length prompts).
    """
    names = _forward_kwargs(model)
    b, p = input_ids.shape
    positions = torch.arange(p, device=input_ids.device)
    kwargs = {names["cache"]: cache, "position_ids": positions.unsqueeze(0).expand(b, p), "use_cache": True}
    if names["cache_position"]:
        kwargs["cache_position"] = positions
    return model(input_ids=input_ids, **kwargs).logits


def make_decode_step(model, cache) -> Callable[..., torch.Tensor]:
    """Return ``step(input_ids, position_ids) -> logits``: one decode token per row through ``cache``.

    ``input_ids`` and ``position_ids`` are ``[B, 1]`` long tensors (all rows at
    the same position); the result is the ``[B, 1, vocab]`` logits tensor
    (only tensors may leave a captured forward, so the ``ModelOutput`` and the
    cache object stay inside). The step writes the cache in place; it holds
    no Python state that changes between calls, so it can be captured.
    """
    names = _forward_kwargs(model)

    def step(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        kwargs = {names["cache"]: cache, "position_ids": position_ids, "use_cache": True}
        if names["cache_position"]:
            kwargs["cache_position"] = position_ids[0]  # a view: rows share one position
        return model(input_ids=input_ids, **kwargs).logits

    return step


def decode_inputs() -> Dict[str, Any]:
    """Return the GraphRunner input spec of the decode step: ``input_ids`` and ``position_ids``, both ``[B, 1]`` long."""
    return {
        "input_ids": BatchInput(trailing=(1,), dtype=torch.long, pad=0),
        "position_ids": BatchInput(trailing=(1,), dtype=torch.long, pad=0),
    }


@dataclass
class DecodeResult:
    """Outcome of :func:`run`: what was compared, how it went, and timings in milliseconds.

    ``mismatches`` lists every step whose logits or cache tensors differed
    from the eager twin (empty: bit-exact). ``capture_ms`` is the whole
    ``runner.capture()`` (warmups included); ``replay_ms`` and ``eager_ms``
    sum the ``steps`` calls of the runner and of the eager twin. ``replays``
    counts runner calls served by a graph replay (not an eager fallback);
    ``num_segments``/``num_breaks`` and ``report`` come from the capture
    report.
    """

    steps: int
    batch: int
    backend: str
    device: str
    max_logit_diff: float = 0.0
    mismatches: List[str] = field(default_factory=list)
    capture_ms: float = 0.0
    replay_ms: float = 0.0
    eager_ms: float = 0.0
    replays: int = 0
    num_segments: int = 0
    num_breaks: int = 0
    report: Any = None

    @property
    def ok(self) -> bool:
        """True when every step's logits and cache tensors matched bit for bit."""
        return not self.mismatches

    def summary(self) -> str:
        """A few human-readable lines."""
        status = "OK: bit-exact" if self.ok else f"MISMATCH ({len(self.mismatches)} problems)"
        lines = [
            f"hf llama decode | backend={self.backend} device={self.device} batch={self.batch} steps={self.steps} "
            f"| {self.num_segments} segment(s), {self.num_breaks} break(s), {self.replays} replays",
            f"  {status}; max |logits diff| = {self.max_logit_diff:.3g}",
            f"  capture {self.capture_ms:.1f} ms | {self.steps} steps: replay {self.replay_ms:.2f} ms, "
            f"eager {self.eager_ms:.2f} ms ({self.eager_ms / max(self.replay_ms, 1e-9):.2f}x)",
        ]
        lines += [f"  - {m}" for m in self.mismatches[:10]]
        return "\n".join(lines)


def run(steps: int = 20, batch: int = 1, backend: str = "breakable", device: Any = "auto", seed: int = 0,
        prompt_len: int = 6, warmups: int = 2, restore_after_capture: bool = True,
        **config_overrides: Any) -> DecodeResult:
    """Capture the decode step, replay ``steps`` steps and compare each with an eager twin.

    The graph model and its eager twin share weights (a deep copy) and each
    has its own ``StaticCache`` of ``batch`` rows (the only bucket) and
    ``prompt_len + steps + warmups + 2`` positions. Both are prefilled with the same random
    prompt; the cache is snapshotted before ``runner.capture()`` and restored
    in place after it (``restore_after_capture=False`` skips that, to show
    that the warmups' writes are then caught as a mismatch). Every step feeds
    both the twin's greedy token; logits and all cache tensors are compared
    with ``torch.equal``. Returns a :class:`DecodeResult`; never raises on a
    mismatch.
    """
    if steps < 1 or batch < 1 or prompt_len < 1:
        raise ValueError(f"steps, batch and prompt_len must be >= 1, got {steps}, {batch}, {prompt_len}")
    dev = gr.get_device(device)
    tdev = dev.torch_device
    result = DecodeResult(steps=steps, batch=batch, backend=backend, device=f"{dev.kind}:{tdev}")
    # Room for the warmups' writes too, so that the restore_after_capture=False control fails by
    # comparison rather than by an index error.
    max_cache_len = prompt_len + steps + warmups + 2
    config_overrides.setdefault("max_position_embeddings", max(DEFAULT_CONFIG["max_position_embeddings"], max_cache_len))

    with torch.inference_mode():
        eager_model = build_model(seed, device=tdev, **config_overrides)
        graph_model = copy.deepcopy(eager_model)
        eager_cache = make_static_cache(eager_model, batch, max_cache_len)
        graph_cache = make_static_cache(graph_model, batch, max_cache_len)

        gen = torch.Generator().manual_seed(seed + 1)
        prompt = torch.randint(0, eager_model.config.vocab_size, (batch, prompt_len), generator=gen).to(tdev)
        want = prefill(eager_model, eager_cache, prompt)
        got = prefill(graph_model, graph_cache, prompt)
        if not torch.equal(want, got):
            result.mismatches.append("prefill logits of the two eager copies differ (nondeterministic kernels?)")
            return result

        runner = GraphRunner(make_decode_step(graph_model, graph_cache), inputs=decode_inputs(),
                             buckets=[batch], backend=backend, device=dev, warmups=warmups, progress=False)
        saved = snapshot_cache(graph_cache)
        t0 = time.perf_counter()
        result.report = runner.capture()
        dev.synchronize()
        result.capture_ms = (time.perf_counter() - t0) * 1e3
        result.num_segments = result.report.bucket(batch).num_segments
        result.num_breaks = result.report.bucket(batch).num_breaks
        if restore_after_capture:
            restore_cache(graph_cache, saved)

        eager_step = make_decode_step(eager_model, eager_cache)
        token = want[:, -1].argmax(-1, keepdim=True)
        for i in range(steps):
            positions = torch.full((batch, 1), prompt_len + i, dtype=torch.long, device=tdev)
            dev.synchronize()
            t0 = time.perf_counter()
            want = eager_step(input_ids=token, position_ids=positions)
            dev.synchronize()
            t1 = time.perf_counter()
            got = runner(input_ids=token, position_ids=positions)
            dev.synchronize()
            t2 = time.perf_counter()
            result.eager_ms += (t1 - t0) * 1e3
            result.replay_ms += (t2 - t1) * 1e3
            if got.shape != want.shape:
                result.mismatches.append(f"step {i}: logits shape {tuple(got.shape)} != eager {tuple(want.shape)}")
                break
            result.max_logit_diff = max(result.max_logit_diff, (got.double() - want.double()).abs().max().item())
            if not torch.equal(got, want):
                result.mismatches.append(f"step {i}: logits differ")
            result.mismatches += [f"step {i}: cache {m}" for m in compare_caches(graph_cache, eager_cache)]
            token = want[:, -1].argmax(-1, keepdim=True)
        result.replays = runner.stats.replays.get(batch, 0)
        runner.cleanup()
    return result


def main(argv: Optional[List[str]] = None) -> int:
    """Command line: run :func:`run` and print its summary; return 0 when bit-exact, else 1."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--backend", default="breakable", choices=["breakable", "full", "eager"])
    p.add_argument("--device", default="auto", choices=["auto", "tape", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=DEFAULT_CONFIG["num_hidden_layers"])
    p.add_argument("--hidden", type=int, default=DEFAULT_CONFIG["hidden_size"])
    args = p.parse_args(argv)
    result = run(steps=args.steps, batch=args.batch, backend=args.backend, device=args.device, seed=args.seed,
                 num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden)
    print(result.summary())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
