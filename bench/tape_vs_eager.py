"""Benchmark: TapeGraph replay vs eager for a decoder decode step on CPU.

Two workloads, random weights from a seed:

* ``llama`` (the headline rows): the demo :class:`~graphrunner.models.LlamaForCausalLM`
  (``LlamaConfig.demo(attention="masked")``: 4 layers, hidden 256, GQA, RoPE, SwiGLU, a static
  KV cache written with ``index_put_``), its whole ``decode_step`` captured, which is what users
  run. Eager is that same ``nn.Module`` call.
* ``inline``: a 4-layer decoder written as one flat function (hidden 256, RMSNorm, attention
  over a static KV cache written with ``index_copy_``, SwiGLU MLP). It has almost no Python
  overhead of its own, so it shows the floor of what replay can save.

For each workload and batch size, eager and replay are timed interleaved in one process
(alternating runs, many reps, medians) and replay is checked bit-exact against eager first.
``--baseline PATH`` also captures with another tape (an older ``tape.py`` or a ``tape/`` package
directory) and times it
in the same interleaving. Prints a table and writes JSON (--out): ``rows`` holds the ``llama``
rows, ``rows_inline`` the ``inline`` ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

from graphrunner.bench import environment, write_json

from graphrunner import tape as _tape


def load_tape(path: str | None):
    """The tape to benchmark: graphrunner.tape, or a copy loaded from ``path``: a
    single-module ``tape.py`` (older versions) or a ``tape/`` package directory."""
    if not path:
        return _tape
    name = f"_tape_{abs(hash(path))}"
    if os.path.isdir(path):  # a package: its relative imports resolve inside the copy
        spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                      submodule_search_locations=[path])
    else:
        spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def build_inline(hidden=256, heads=4, layers=4, ffn=688, max_len=128, batch=1, seed=0):
    """The flat decoder: returns (step, set_inputs, caches); ``step()`` reads its inputs in place."""
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

    def set_inputs(p, seed):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
        pos.fill_(p)
        mask.fill_(float("-inf"))
        mask[..., : p + 1] = 0.0

    return step, set_inputs, kc + vc


def build_llama(batch=1, seed=0):
    """The demo Llama decode step over static inputs: returns (step, set_inputs, caches)."""
    from graphrunner.models import LlamaConfig, build_model

    model = build_model(LlamaConfig.demo(attention="masked"), seed=seed)
    ids = torch.zeros(batch, dtype=torch.long)
    pos = torch.zeros(batch, dtype=torch.long)

    def step():
        return model.decode_step(ids, pos)

    def set_inputs(p, seed):
        g = torch.Generator().manual_seed(seed)
        ids.copy_(torch.randint(0, model.config.vocab_size, (batch,), generator=g))
        pos.fill_(p)

    return step, set_inputs, model.kv_cache_tensors()


BUILDERS = {"llama": build_llama, "inline": build_inline}


def bench_batch(model, batch, reps, inner, tapes):
    """Time eager and a replay per tape module in ``tapes`` (name -> module), interleaved."""
    step, set_inputs, caches = BUILDERS[model](batch=batch)
    row = dict(model=model, batch=batch)
    with torch.inference_mode():
        set_inputs(3, 0)
        for _ in range(3):
            step()  # warm up
        graphs = {}
        for name, mod in tapes.items():
            g = mod.TapeGraph()
            t0 = time.perf_counter()
            with mod.tape_graph(g):
                out = step()
            cap_ms = (time.perf_counter() - t0) * 1e3
            # correctness: replay == eager on new inputs (cache state restored between)
            set_inputs(5, 1)
            snap = [c.clone() for c in caches]
            g.replay()
            got = out.clone()
            for c, s in zip(caches, snap):
                c.copy_(s)
            exact = bool(torch.equal(got, step()))
            graphs[name] = g
            sfx = "" if name == "new" else f"_{name}"
            row.update({f"bit_exact{sfx}": exact, f"num_ops{sfx}": g.num_ops,
                        f"replayed_ops{sfx}": g.num_replayed_ops, f"capture_ms{sfx}": cap_ms})
        times = {"eager": []}
        times.update({name: [] for name in graphs})
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(inner):
                step()
            times["eager"].append((time.perf_counter() - t) / inner)
            for name, g in graphs.items():
                t = time.perf_counter()
                for _ in range(inner):
                    g.replay()
                times[name].append((time.perf_counter() - t) / inner)
    e = statistics.median(times["eager"])
    row["eager_us"] = e * 1e6
    for name in graphs:
        r = statistics.median(times[name])
        sfx = "" if name == "new" else f"_{name}"
        row[f"replay_us{sfx}"] = r * 1e6
        row[f"speedup{sfx}"] = e / r
    return row


def print_table(rows, baseline: bool):
    head = f"{'model':>6} {'batch':>5} {'eager us':>9} {'replay us':>9} {'speedup':>8} {'exact':>6} {'ops':>4} {'replayed':>8} {'capture ms':>10}"
    if baseline:
        head += f" {'base us':>8} {'base spd':>8} {'base ops':>8}"
    print(head)
    for r in rows:
        line = (f"{r['model']:>6} {r['batch']:>5} {r['eager_us']:>9.1f} {r['replay_us']:>9.1f} {r['speedup']:>7.2f}x "
                f"{str(r['bit_exact']):>6} {r['num_ops']:>4} {r['replayed_ops']:>8} {r['capture_ms']:>10.1f}")
        if baseline:
            line += f" {r['replay_us_base']:>8.1f} {r['speedup_base']:>7.2f}x {r['replayed_ops_base']:>8}"
        print(line)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("bench", "results", "tape_vs_eager.json"))
    ap.add_argument("--models", default="llama,inline", help="comma list of: llama, inline")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--tape", default=os.environ.get("GRAPHRUNNER_TAPE_IMPL"),
                    help="benchmark this tape.py / tape package directory instead of graphrunner.tape "
                         "(default: $GRAPHRUNNER_TAPE_IMPL)")
    ap.add_argument("--baseline", default=None, help="also time replay with this tape.py / tape package directory, interleaved")
    ap.add_argument("--quick", action="store_true", help="smoke run: batches 1,8, 3 reps of 5")
    a = ap.parse_args(argv)
    if a.quick:
        a.batches, a.reps, a.inner = "1,8", 3, 5
    if a.threads:
        torch.set_num_threads(a.threads)
    tapes = {"new": load_tape(a.tape)}
    if a.baseline:
        tapes["base"] = load_tape(a.baseline)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in models:
        if m not in BUILDERS:
            ap.error(f"unknown model {m!r} (choose from {', '.join(BUILDERS)})")
    rows = [bench_batch(m, int(b), a.reps, a.inner, tapes) for m in models for b in a.batches.split(",")]
    print_table(rows, bool(a.baseline))
    result = dict(torch=torch.__version__, threads=torch.get_num_threads(), environment=environment(),
                  rows=[r for r in rows if r["model"] == "llama"],
                  rows_inline=[r for r in rows if r["model"] == "inline"])
    write_json(a.out, result, announce=True)
    return result


if __name__ == "__main__":
    main()
