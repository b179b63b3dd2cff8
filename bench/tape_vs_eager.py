"""Benchmark: TapeGraph replay vs eager for a 4-layer decoder step on CPU.

The decoder (hidden 256, RMSNorm, attention over a static KV cache written with
index_copy_, SwiGLU MLP) is built inline with random weights from a seed.  For
each batch size, eager and replay are timed interleaved in one process
(alternating runs, many reps, medians) and replay is checked bit-exact against
eager first.  Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from graphrunner.tape import TapeGraph, tape_graph


def build(hidden=256, heads=4, layers=4, ffn=688, max_len=128, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    W = [dict(n1=torch.ones(hidden), n2=torch.ones(hidden), qkv=r(3 * hidden, hidden), o=r(hidden, hidden),
              gate=r(ffn, hidden), up=r(ffn, hidden), down=r(hidden, ffn)) for _ in range(layers)]
    hd = hidden // heads
    kc = [torch.zeros(batch, heads, max_len, hd) for _ in range(layers)]
    vc = [torch.zeros(batch, heads, max_len, hd) for _ in range(layers)]
    x = torch.randn(batch, 1, hidden, generator=g)
    pos = torch.tensor([0])
    mask = torch.zeros(1, 1, 1, max_len)  # static attention mask (-inf beyond pos)
    F = torch.nn.functional

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def step():
        h = x
        for i, w in enumerate(W):
            a = rms(h, w["n1"])
            q, k, v = F.linear(a, w["qkv"]).split(hidden, dim=-1)
            q = q.view(batch, 1, heads, hd).transpose(1, 2)
            k = k.view(batch, 1, heads, hd).transpose(1, 2)
            v = v.view(batch, 1, heads, hd).transpose(1, 2)
            kc[i].index_copy_(2, pos, k)
            vc[i].index_copy_(2, pos, v)
            s = (q @ kc[i].transpose(-1, -2)) * (hd ** -0.5) + mask
            o = (s.softmax(-1) @ vc[i]).transpose(1, 2).reshape(batch, 1, hidden)
            h = h + F.linear(o, w["o"])
            m = rms(h, w["n2"])
            h = h + F.linear(F.silu(F.linear(m, w["gate"])) * F.linear(m, w["up"]), w["down"])
        return h

    def set_pos(p):
        pos.fill_(p)
        mask.fill_(float("-inf"))
        mask[..., : p + 1] = 0.0

    return step, x, set_pos, kc + vc


def bench_batch(batch, reps, inner):
    step, x, set_pos, caches = build(batch=batch)
    with torch.inference_mode():
        set_pos(3)
        for _ in range(3):
            step()  # warm up
        g = TapeGraph()
        t0 = time.perf_counter()
        with tape_graph(g):
            out = step()
        capture_s = time.perf_counter() - t0
        # correctness: replay == eager for the same inputs (cache state restored between)
        x.copy_(torch.randn_like(x))
        snap = [c.clone() for c in caches]
        g.replay()
        got = out.clone()
        for c, s in zip(caches, snap):
            c.copy_(s)
        exact = bool(torch.equal(got, step()))
        te, tr = [], []
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(inner):
                step()
            te.append((time.perf_counter() - t) / inner)
            t = time.perf_counter()
            for _ in range(inner):
                g.replay()
            tr.append((time.perf_counter() - t) / inner)
    e, r = statistics.median(te), statistics.median(tr)
    return dict(batch=batch, eager_us=e * 1e6, replay_us=r * 1e6, speedup=e / r, bit_exact=exact,
                num_ops=g.num_ops, replayed_ops=g.num_replayed_ops, capture_ms=capture_s * 1e3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("bench", "results", "tape_vs_eager.json"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = [bench_batch(int(b), a.reps, a.inner) for b in a.batches.split(",")]
    print(f"{'batch':>5} {'eager us':>10} {'replay us':>10} {'speedup':>8} {'exact':>6} {'ops':>5} {'replayed':>8} {'capture ms':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['eager_us']:>10.1f} {r['replay_us']:>10.1f} {r['speedup']:>7.2f}x "
              f"{str(r['bit_exact']):>6} {r['num_ops']:>5} {r['replayed_ops']:>8} {r['capture_ms']:>10.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(torch=torch.__version__, threads=torch.get_num_threads(), rows=rows), f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
