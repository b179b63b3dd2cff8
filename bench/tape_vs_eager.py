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
in the same interleaving. The *kernel floor* (``floor_us``) is the isolated time of each op the
replay runs, summed (each statement of the generated replay timed alone on the capture's
values); a second table prints tape/floor, eager/tape and, with ``--inductor``, inductor/tape
(``torch.compile`` steady state) side by side. Prints the tables and writes JSON (--out):
``rows`` holds the ``llama`` rows, ``rows_inline`` the ``inline`` ones.
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


def _timed(code, ns, n) -> float:
    """Seconds per ``exec(code, ns)``, the median of 5 runs of ``n``."""
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            exec(code, ns)
        runs.append((time.perf_counter() - t) / n)
    return statistics.median(runs)


_REPLAY = compile("g.replay()", "<bench>", "exec")


def kernel_floor(g, n=20) -> tuple[float, list]:
    """The kernel floor of a captured graph: the isolated time of each op its
    replay runs (each statement of the generated replay timed alone on the
    capture's values, minus the cost of executing an empty statement),
    summed.  Returns (seconds, [(seconds, statement)] slowest first)."""
    body = g.source.split("def _replay():\n", 1)[1].rsplit("\n    return _replay", 1)[0]
    lines = [ln.strip() for ln in body.splitlines()]
    lines = [ln for ln in lines if ln and ln != "pass" and not ln.startswith("del ")]
    ns = dict(g._env)
    codes = [compile(ln, "<floor>", "exec") for ln in lines]
    per = []
    mode = torch.inference_mode() if g._inference else torch.no_grad()
    with mode, torch._C.DisableTorchFunction():
        for c in codes:  # every value once, so each statement can run alone
            exec(c, ns)
        base = _timed(compile("pass", "<floor>", "exec"), ns, n * 10)
        for c, ln in zip(codes, lines):
            per.append((max(0.0, _timed(c, ns, n) - base), ln))
    return sum(t for t, _ in per), sorted(per, reverse=True)


def time_inductor(step, reps, inner) -> "float | None":
    """Median seconds per call of ``torch.compile(step)`` (inductor) in steady
    state, or None if it cannot compile here."""
    try:
        fn = torch.compile(step, backend="inductor", dynamic=False)
        for _ in range(3):
            fn()
    except Exception as exc:  # noqa: BLE001 - a bench reports, it does not fail
        print(f"inductor unavailable: {type(exc).__name__}: {exc}"[:200])
        return None
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        ts.append((time.perf_counter() - t) / inner)
    return statistics.median(ts)


def bench_batch(model, batch, reps, inner, tapes, floor=True, inductor=False):
    """Time eager and a replay per tape module in ``tapes`` (name -> module),
    interleaved; then the kernel floor of the new tape's graph and, if asked,
    inductor's steady state."""
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
        if floor:
            # replay timed right around the floor, so that tape/floor compares
            # two measurements made under the same machine load
            g = graphs["new"]
            near = [_timed(_REPLAY, {"g": g}, inner)]
            fl, per = kernel_floor(g)
            near.append(_timed(_REPLAY, {"g": g}, inner))
            row["replay_near_floor_us"] = statistics.mean(near) * 1e6
            row["floor_us"] = fl * 1e6
            row["floor_top"] = [(round(t * 1e6, 2), ln[:80]) for t, ln in per[:5]]
        if inductor:
            ind = time_inductor(step, reps, inner)
            row["inductor_us"] = ind * 1e6 if ind is not None else None
    e = statistics.median(times["eager"])
    row["eager_us"] = e * 1e6
    for name in graphs:
        r = statistics.median(times[name])
        sfx = "" if name == "new" else f"_{name}"
        row[f"replay_us{sfx}"] = r * 1e6
        row[f"speedup{sfx}"] = e / r
    if row.get("floor_us"):
        row["tape_over_floor"] = row["replay_near_floor_us"] / row["floor_us"]
    if row.get("inductor_us"):
        row["inductor_over_tape"] = row["inductor_us"] / row["replay_us"]
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
    if any("floor_us" in r for r in rows):
        print()
        print(f"{'model':>6} {'batch':>5} {'floor us':>9} {'tape/floor':>10} {'eager/tape':>10} {'inductor/tape':>13}")
        for r in rows:
            ind = r.get("inductor_over_tape")
            print(f"{r['model']:>6} {r['batch']:>5} {r.get('floor_us', float('nan')):>9.1f} "
                  f"{r.get('tape_over_floor', float('nan')):>10.2f} {r['speedup']:>10.2f} "
                  f"{(f'{ind:.2f}' if ind else '-'):>13}")


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
    ap.add_argument("--no-floor", action="store_true", help="skip the kernel floor (each replayed op timed alone)")
    ap.add_argument("--inductor", action="store_true",
                    help="also time torch.compile (inductor) steady state (compiles once per model and batch)")
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
    rows = [bench_batch(m, int(b), a.reps, a.inner, tapes, floor=not a.no_floor, inductor=a.inductor)
            for m in models for b in a.batches.split(",")]
    print_table(rows, bool(a.baseline))
    result = dict(torch=torch.__version__, threads=torch.get_num_threads(), environment=environment(),
                  rows=[r for r in rows if r["model"] == "llama"],
                  rows_inline=[r for r in rows if r["model"] == "inline"])
    write_json(a.out, result, announce=True)
    return result


if __name__ == "__main__":
    main()
