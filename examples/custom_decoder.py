"""Your own decoder through ``gr.GraphRunner``: a slot-indexed KV cache with a scratch slot.

A small Llama-style decoder written in plain PyTorch (embedding, RMSNorm, rotary attention,
SwiGLU MLP, LM head; random weights, nothing downloaded) serves a few requests with greedy
decoding. Each request owns one KV-cache slot from admission to finish; the batch row ->
slot mapping is an input tensor (``slots``). The cache has one slot more than requests can
hold: the **scratch slot**, which no request ever owns. Padding rows (what the runner adds to
reach a bucket) point at it, so they write and read only there and never touch a request.

The decode step is captured once per bucket and replayed; every generated token is checked
against an eager twin (the same model and weights, no graph): bit for bit on the padded batch
at every step, and token for token against an eager engine that never pads.
docs/tutorial.md walks through this file.

Run it from the repository root::

    python examples/custom_decoder.py                     # breakable: attention is an eager break
    python examples/custom_decoder.py --backend full      # one graph per bucket: masked attention
    python examples/custom_decoder.py --pad-slot 0        # break the padding rule: tokens differ

With ``--pad-slot 0`` the padding check refuses the capture (``PaddingLeakError`` naming the
``slots`` input and the cache cells the padding rows write: a later call of the request in slot 0
reads them); the example turns that check off to serve anyway and show the tokens change.

It prints a short summary and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import graphrunner as gr

VOCAB, HIDDEN, HEADS, LAYERS, FFN = 128, 64, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
MAX_LEN = 32  # cache positions per slot: positions 0..31
NUM_SLOTS = 8  # requests in flight at most; they own slots 0..7
SCRATCH = NUM_SLOTS  # slot 8: owned by no request; every padding row writes and reads here
BUCKETS = [1, 2, 4, 8]


# --------------------------------------------------------------------------- the model
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [B, heads, HEAD_DIM]`` at ``positions [B]``."""
    inv_freq = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2, device=x.device) / HEAD_DIM)
    angle = (positions[:, None].float() * inv_freq)[:, None]  # [B, 1, HEAD_DIM/2]
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()), -1)


def _attend(q, k, v, positions):
    """q ``[B, H, D]``, k/v ``[B, H, L, D]``: row ``b`` sees cache positions ``0..positions[b]``."""
    scores = torch.einsum("bhd,bhld->bhl", q, k) / math.sqrt(HEAD_DIM)
    future = torch.arange(k.shape[2], device=q.device) > positions[:, None, None]
    return torch.einsum("bhl,bhld->bhd", scores.masked_fill(future, float("-inf")).softmax(-1), v)


def masked_attention(q, k_cache, v_cache, slots, positions):
    """Capturable: attends over all MAX_LEN positions of each row's slot, masked. Its shapes
    depend only on the batch, so it can live inside a full graph."""
    return _attend(q, k_cache[slots], v_cache[slots], positions)


@gr.no_graph
def varlen_attention(q, k_cache, v_cache, slots, positions):
    """An eager break: reads the longest length on the host (``int(...)``, which a graph would
    freeze at its capture-time value) and gathers only that many positions. It returns a
    tensor whose shape depends only on the batch, as a break must."""
    n = int(positions.max()) + 1
    return _attend(q, k_cache[slots, :, :n], v_cache[slots, :, :n], positions)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.gate_up = nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)


class TinyDecoder(nn.Module):
    """``forward(input_ids[B], positions[B], slots[B]) -> logits[B, VOCAB]``: one decode step.

    Row ``b`` writes its key/value at ``(slots[b], positions[b])`` of the cache and attends to
    positions ``0..positions[b]`` of slot ``slots[b]``. ``attention`` is ``"varlen"`` (an eager
    break, for ``backend="breakable"``) or ``"masked"`` (capturable, for ``backend="full"``).
    Weights come from ``seed``: two models with one seed are twins.
    """

    def __init__(self, attention: str = "varlen", seed: int = 0, device="cpu") -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
            self.norm = RMSNorm(HIDDEN)
            self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        # The KV cache: one row per request slot PLUS the scratch slot. Allocated once and only
        # written in place: a captured graph holds its address.
        shape = (LAYERS, NUM_SLOTS + 1, HEADS, MAX_LEN, HEAD_DIM)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)
        self.attention = {"varlen": varlen_attention, "masked": masked_attention}[attention]
        self.to(device).requires_grad_(False).eval()

    def forward(self, input_ids, positions, slots):
        h = self.embed(input_ids)  # [B, HIDDEN]
        b = h.shape[0]
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(layer.attn_norm(h)).view(b, 3, HEADS, HEAD_DIM).unbind(1)
            q, k = rope(q, positions), rope(k, positions)
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]  # views: [slots, H, L, D]
            k_cache[slots, :, positions] = k  # write in place at
            v_cache[slots, :, positions] = v  # (slot, position)
            h = h + layer.o(self.attention(q, k_cache, v_cache, slots, positions).reshape(b, HIDDEN))
            gate, up = layer.gate_up(layer.mlp_norm(h)).chunk(2, -1)
            h = h + layer.down(F.silu(gate) * up)
        return self.lm_head(self.norm(h))


# --------------------------------------------------------------------------- the runner
def make_runner(
    model: TinyDecoder, backend: str = "breakable", pad_slot: int = SCRATCH, device="auto", **kwargs
) -> gr.GraphRunner:
    """A GraphRunner over ``model``'s decode step with buckets 1, 2, 4, 8.

    ``bounds=`` are the ranges of the *real* values; the padding check at capture draws real
    cells from them. Padding rows get token 0 at position 0 in slot ``pad_slot``: the scratch
    slot by default, outside the slots' bounds because no request owns it.
    ``kwargs`` go to ``gr.GraphRunner`` (``checks=``, ``debug=``, ...)."""
    inputs = {
        "input_ids": gr.BatchInput(dtype=torch.long, pad=0, bounds=(0, VOCAB - 1)),
        "positions": gr.BatchInput(dtype=torch.long, pad=0, bounds=(0, MAX_LEN - 1)),
        "slots": gr.BatchInput(dtype=torch.long, pad=pad_slot, bounds=(0, NUM_SLOTS - 1)),
    }
    kwargs.setdefault("progress", False)
    return gr.GraphRunner(model, inputs=inputs, buckets=BUCKETS, backend=backend, device=device, **kwargs)


# --------------------------------------------------------------------------- a tiny engine
def make_requests(n: int = 12, seed: int = 0):
    """``n`` requests: (prompt tokens, tokens to generate), lengths drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for _ in range(n):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen)
        reqs.append((prompt.tolist(), int(torch.randint(1, 16, (1,), generator=gen))))
    return reqs


def serve(step: Callable, requests, device="cpu", on_step: Callable | None = None) -> list[list[int]]:
    """Greedy decoding of every request with at most NUM_SLOTS in flight; returns the generated
    tokens of each. One request arrives per step; it takes a free slot when admitted and gives
    it back when done.
    Prompts go through the decode step one token per step (no separate prefill, to stay short),
    so rows sit at different positions and the batch size changes as requests come and go.
    ``on_step(inputs, logits)`` sees every step."""
    tokens = [list(prompt) for prompt, _ in requests]
    out: list[list[int]] = [[] for _ in requests]
    pos = [0] * len(requests)
    waiting, free, running = list(range(len(requests))), list(range(NUM_SLOTS)), {}
    while waiting or running:
        if waiting and free:
            running[waiting.pop(0)] = free.pop(0)  # request -> its slot
        rows = list(running)
        inputs = {
            "input_ids": torch.tensor([tokens[r][pos[r]] for r in rows], device=device),
            "positions": torch.tensor([pos[r] for r in rows], device=device),
            "slots": torch.tensor([running[r] for r in rows], device=device),
        }
        logits = step(**inputs)
        if on_step is not None:
            on_step(inputs, logits)
        for r, t in zip(rows, logits.argmax(-1).tolist()):
            pos[r] += 1
            if pos[r] == len(tokens[r]):  # past the prompt: a new token
                tokens[r].append(t)
                out[r].append(t)
                if len(out[r]) == requests[r][1]:
                    free.append(running.pop(r))
    return out


def pad_to(inputs, bucket: int, pads) -> dict:
    """The padded batch a replay of ``bucket`` computes: each input padded with its pad value."""
    return {k: torch.cat([v, v.new_full((bucket - len(v),), pads[k])]) for k, v in inputs.items()}


# --------------------------------------------------------------------------- the eager twin check
@dataclass
class Result:
    backend: str
    graph_tokens: list[list[int]]
    eager_tokens: list[list[int]]
    steps: int = 0
    padded_steps: int = 0  # steps that replayed a bucket larger than the batch
    padded_equal: int = 0  # steps where the graph equals the twin on the padded batch, bit for bit
    max_real_diff: float = 0.0  # graph vs the unpadded eager engine, real rows, same step
    replays: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.graph_tokens == self.eager_tokens and self.padded_equal == self.steps

    def summary(self) -> str:
        n = sum(len(t) for t in self.graph_tokens)
        same = sum(a == b for g, e in zip(self.graph_tokens, self.eager_tokens) for a, b in zip(g, e))
        return (
            f"backend={self.backend}: {self.steps} steps ({self.padded_steps} padded), replays per bucket "
            f"{self.replays}\n"
            f"  graph == eager twin on the padded batch (torch.equal): {self.padded_equal}/{self.steps} steps\n"
            f"  graph vs eager engine without padding: {same}/{n} tokens equal, "
            f"max |logit diff| on real rows {self.max_real_diff:.2g}\n" + ("OK" if self.ok else "MISMATCH")
        )


def run(
    backend: str = "breakable", pad_slot: int = SCRATCH, device="auto", requests=None, seed: int = 0, **runner_kwargs
) -> Result:
    """Serve ``requests`` through a captured runner and check it against eager twins.

    ``backend="full"`` uses the masked attention (a full graph cannot hold the varlen break).
    Three models with one seed: the served one (graphs), a twin fed the same padded batch
    eagerly at every step (must be bit for bit equal), and an eager engine that never pads
    (same tokens; logits within float tolerance)."""
    dev = gr.get_device(device)
    attention = "masked" if backend == "full" else "varlen"
    model, twin, eager = (TinyDecoder(attention, seed, dev.torch_device) for _ in range(3))
    runner = make_runner(model, backend, pad_slot, device=dev, **runner_kwargs)
    runner.capture()
    requests = make_requests() if requests is None else requests
    pads = {name: spec.pad for name, spec in runner.inputs.items()}
    res = Result(backend, [], [])
    graph_logits: list[torch.Tensor] = []

    def check(inputs, logits):
        res.steps += 1
        bucket = runner.stats.last_bucket or len(logits)
        res.padded_steps += bucket > len(logits)
        with torch.inference_mode():
            ref = twin(**pad_to(inputs, bucket, pads))[: len(logits)]
        res.padded_equal += torch.equal(logits, ref)
        graph_logits.append(logits.clone())  # outputs are views: keep a copy

    with torch.inference_mode():
        res.graph_tokens = serve(runner, requests, dev.torch_device, on_step=check)
        eager_logits: list[torch.Tensor] = []
        res.eager_tokens = serve(
            eager, requests, dev.torch_device, on_step=lambda inputs, logits: eager_logits.append(logits)
        )
    if len(eager_logits) == len(graph_logits):  # same schedule: compare per step
        res.max_real_diff = max(
            float((g - e).abs().max()) for g, e in zip(graph_logits, eager_logits) if g.shape == e.shape
        )
    res.replays = dict(runner.stats.replays)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("breakable", "full", "both"), default="both")
    p.add_argument("--device", choices=("auto", "tape", "cuda"), default="auto")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--pad-slot",
        type=int,
        default=SCRATCH,
        help=f"cache slot of the padding rows (default {SCRATCH}, the scratch slot; 0 breaks the rule)",
    )
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error(f"--requests must be >= 1, got {args.requests}")
    if not 0 <= args.pad_slot <= SCRATCH:
        p.error(f"--pad-slot must be a cache slot in 0..{SCRATCH}, got {args.pad_slot}")
    kwargs = {}
    if args.pad_slot != SCRATCH:  # the padding check refuses this capture (tested); serve anyway to show why
        kwargs["checks"] = ("drift", "fingerprint")
    ok = True
    for backend in ("breakable", "full") if args.backend == "both" else (args.backend,):
        res = run(backend, args.pad_slot, args.device, make_requests(args.requests, args.seed), args.seed, **kwargs)
        print(res.summary())
        ok &= res.ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
