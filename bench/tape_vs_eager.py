"""Benchmark: TapeGraph replay vs eager for a decoder decode step on CPU.

Four workloads, random weights from a seed:

* ``llama`` (the headline rows): the demo :class:`~graphrunner_tools.models.LlamaForCausalLM`
  (``LlamaConfig.demo(attention="masked")``: 4 layers, hidden 256, GQA, RoPE, SwiGLU, a static
  KV cache written with ``index_put_``), its whole ``decode_step`` captured, which is what users
  run. Eager is that same ``nn.Module`` call.
* ``gpt2``: a GPT-2-style step written as one function (4 layers, hidden 256, LayerNorm, learned
  positions, biased linears, GELU, tied LM head, static KV cache, masked attention).
* ``hf_llama``: a transformers ``LlamaForCausalLM`` (tiny config, random weights) decoding
  through a ``StaticCache`` (skipped without transformers).
* ``inline``: a 4-layer decoder written as one flat function (hidden 256, RMSNorm, attention
  over a static KV cache written with ``index_copy_``, SwiGLU MLP). It has almost no Python
  overhead of its own, so it shows the floor of what replay can save.

For each workload and batch size, eager and replay (and, if asked, inductor and TorchScript)
are timed interleaved in one process (one run of each in turn, many reps, medians), replay with
both engines (the default, a TorchScript trace of the generated code where it can, and the
generated Python: ``replay_us_python``), and replay
is checked bit-exact against eager first. ``--clock cpu`` (the default with one torch thread)
times with the thread's CPU time, so other processes on a shared machine do not inflate them.
``--baseline PATH`` also captures with another tape (an older ``tape.py`` or a ``tape/`` package
directory) and times it in the same interleaving, floors included. Two *kernel floors* per
graph: ``floor_us``, the isolated time of each op the replay runs (each statement of the
generated replay timed alone on the capture's values, warm caches), summed, and
``floor_seq_us``, each statement timed while the replay's statements run in order (the
replay's cache state). A second table prints tape/floor, tape/floor_seq, eager/floor and, with
``--inductor`` / ``--torchscript``, inductor/tape and TorchScript/tape side by side. Prints the
tables (progress on stderr) and writes every field to JSON (--out): ``rows`` holds the ``llama`` rows, ``rows_gpt2``,
``rows_hf_llama`` and ``rows_inline`` the others.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import statistics
import sys
import time

import torch

from graphrunner import tape as _tape
from graphrunner_tools.bench import environment, progress_line, write_json


def load_tape(path: str | None):
    """The tape to benchmark: graphrunner.tape, or a copy loaded from ``path``: a
    single-module ``tape.py`` (older versions) or a ``tape/`` package directory."""
    if not path:
        return _tape
    name = f"_tape_{abs(hash(path))}"
    if os.path.isdir(path):  # a package: its relative imports resolve inside the copy
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(path, "__init__.py"), submodule_search_locations=[path]
        )
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
    W = [
        dict(
            n1=torch.ones(hidden),
            n2=torch.ones(hidden),
            qkv=r(3 * hidden, hidden),
            o=r(hidden, hidden),
            gate=r(ffn, hidden),
            up=r(ffn, hidden),
            down=r(hidden, ffn),
        )
        for _ in range(layers)
    ]
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
            s = (q @ kc[i].transpose(-1, -2)) * (hd**-0.5) + mask
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
    from graphrunner_tools.models import LlamaConfig, build_model

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


def build_gpt2(batch=1, seed=0, hidden=256, heads=4, layers=4, vocab=1024, max_len=256):
    """A GPT-2-style decode step written as one function (LayerNorm, learned positions,
    fused QKV with bias, GELU MLP, tied LM head, a static KV cache written with
    ``index_copy_``, masked attention over all positions): returns (step, set_inputs, caches)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.02  # noqa: E731
    wte, wpe = r(vocab, hidden), r(max_len, hidden)
    W = [
        dict(
            ln1=(torch.ones(hidden), torch.zeros(hidden)),
            ln2=(torch.ones(hidden), torch.zeros(hidden)),
            qkv=(r(3 * hidden, hidden), r(3 * hidden)),
            o=(r(hidden, hidden), r(hidden)),
            fc=(r(4 * hidden, hidden), r(4 * hidden)),
            proj=(r(hidden, 4 * hidden), r(hidden)),
        )
        for _ in range(layers)
    ]
    lnf = (torch.ones(hidden), torch.zeros(hidden))
    hd = hidden // heads
    kc = [torch.zeros(batch, heads, max_len, hd) for _ in range(layers)]
    vc = [torch.zeros(batch, heads, max_len, hd) for _ in range(layers)]
    ids = torch.zeros(batch, 1, dtype=torch.long)
    pos = torch.tensor([0])
    mask = torch.zeros(1, 1, 1, max_len)
    F = torch.nn.functional

    def step():
        h = F.embedding(ids, wte) + F.embedding(pos, wpe)
        for i, w in enumerate(W):
            a = F.layer_norm(h, (hidden,), *w["ln1"])
            q, k, v = F.linear(a, *w["qkv"]).split(hidden, dim=-1)
            q = q.view(batch, 1, heads, hd).transpose(1, 2)
            kc[i].index_copy_(2, pos, k.view(batch, 1, heads, hd).transpose(1, 2))
            vc[i].index_copy_(2, pos, v.view(batch, 1, heads, hd).transpose(1, 2))
            s = (q @ kc[i].transpose(-1, -2)) * (hd**-0.5) + mask
            o = (s.softmax(-1) @ vc[i]).transpose(1, 2).reshape(batch, 1, hidden)
            h = h + F.linear(o, *w["o"])
            m = F.layer_norm(h, (hidden,), *w["ln2"])
            h = h + F.linear(F.gelu(F.linear(m, *w["fc"]), approximate="tanh"), *w["proj"])
        return F.linear(F.layer_norm(h, (hidden,), *lnf), wte)

    def set_inputs(p, seed):
        ids.copy_(torch.randint(0, vocab, ids.shape, generator=torch.Generator().manual_seed(seed)))
        pos.fill_(p)
        mask.fill_(float("-inf"))
        mask[..., : p + 1] = 0.0

    return step, set_inputs, kc + vc


def build_hf_llama(batch=1, seed=0):
    """A transformers ``LlamaForCausalLM`` (tiny config, random weights: 4 layers, hidden 256,
    GQA) decoding one token per row through a ``StaticCache`` of 256 positions, its step
    from :func:`graphrunner.hf.steps.make_decode_step`: returns (step, set_inputs, caches)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from graphrunner.hf.cache import cache_tensors, make_static_cache
    from graphrunner.hf.steps import make_decode_step

    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)  # plain tensors: torch.jit.trace can run it
    cache = make_static_cache(model, batch, 256)
    fwd = make_decode_step(model, cache)
    ids = torch.zeros(batch, 1, dtype=torch.long)
    pos = torch.zeros(batch, 1, dtype=torch.long)
    with torch.inference_mode():
        fwd(ids, pos)  # a lazily allocating cache gets its tensors here, outside any capture

    # transformers 5 advances a write counter at every call: rewind it to the
    # position first, so that the step can run any number of times
    counters = [
        c
        for layer in getattr(cache, "layers", ())
        if isinstance(c := getattr(layer, "cumulative_length", None), torch.Tensor)
    ]

    def step():
        for c in counters:
            c.copy_(pos[0, 0])
        return fwd(ids, pos)

    def set_inputs(p, seed):
        ids.copy_(torch.randint(0, cfg.vocab_size, ids.shape, generator=torch.Generator().manual_seed(seed)))
        pos.fill_(p)

    return step, set_inputs, list(cache_tensors(cache).values())


BUILDERS = {"llama": build_llama, "gpt2": build_gpt2, "hf_llama": build_hf_llama, "inline": build_inline}


_CLOCK = time.perf_counter  # --clock: wall (perf_counter) or cpu (this thread's CPU time)


def _timed(code, ns, n) -> float:
    """Seconds per ``exec(code, ns)``, the median of 5 runs of ``n``."""
    runs = []
    for _ in range(5):
        t = _CLOCK()
        for _ in range(n):
            exec(code, ns)
        runs.append((_CLOCK() - t) / n)
    return statistics.median(runs)


_REPLAY = compile("g.replay()", "<bench>", "exec")


def _statements(g) -> list:
    """The statements of ``g``'s generated replay, in order."""
    body = g.source.split("def _replay():\n", 1)[1].rsplit("\n    return _replay", 1)[0]
    return [ln.strip() for ln in body.splitlines() if ln.strip() and ln.strip() != "pass"]


def kernel_floor(g, n=20) -> tuple[float, list]:
    """The kernel floor of a captured graph: the isolated time of each op its
    replay runs (each statement of the generated replay timed alone on the
    capture's values, ``n`` times back to back, minus the cost of executing an
    empty statement), summed.  Warm: each op finds its inputs, weights and
    code in cache.  Returns (seconds, [(seconds, statement)] slowest first)."""
    lines = [ln for ln in _statements(g) if not ln.startswith("del ")]
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


def kernel_floor_in_sequence(g, passes=15) -> tuple[float, list]:
    """The floor with the replay's cache state: each statement of the generated
    replay timed alone (wall clock, ``perf_counter_ns``) while the statements
    run in replay order, median over ``passes`` passes, minus the timer's own
    cost, summed (``del`` statements run untimed).  Unlike
    :func:`kernel_floor`, each op finds weights and activations where the
    previous ops left them (L3 or memory for a model bigger than L2).
    Returns (seconds, [(seconds, statement)] in replay order)."""
    lines = _statements(g)
    ns = dict(g._env)
    codes = [(compile(ln, "<floor>", "exec"), ln.startswith("del ")) for ln in lines]
    clock = time.perf_counter_ns
    per = [[] for _ in codes]
    mode = torch.inference_mode() if g._inference else torch.no_grad()
    with mode, torch._C.DisableTorchFunction():
        empty = compile("pass", "<floor>", "exec")
        base = []
        for _ in range(2000):
            t = clock()
            exec(empty, ns)
            base.append(clock() - t)
        base = statistics.median(base)
        for _ in range(passes):
            for j, (c, is_del) in enumerate(codes):
                if is_del:
                    exec(c, ns)
                    continue
                t = clock()
                exec(c, ns)
                per[j].append(clock() - t)
    timed = [(max(0.0, statistics.median(p) - base) / 1e9, ln) for p, ln in zip(per, lines) if p]
    return sum(t for t, _ in timed), timed


_CALLEE = re.compile(r"^(?:[\w, ]+ = )?(\w+)(?:\.(\w+))?\(")


def callee(g, statement: str) -> str:
    """What a statement of ``g``'s generated replay calls: the binding's name
    (``mm``, ``mul``, a Tensor method such as ``copy_``) or, for a call
    through the aten op, the op's name (``aten.index_put_.default``)."""
    m = _CALLEE.match(statement)
    if m is None:
        return "?"
    head, method = m.groups()
    if method is not None:
        return method
    labels = getattr(g, "_labels", {})
    if head in labels:
        return labels[head]
    fn = g._env.get(head)
    return getattr(fn, "__name__", None) or type(fn).__name__


def profile_by_callee(g, timed) -> list:
    """Where replay time goes: the in-sequence statement times of ``g``
    (:func:`kernel_floor_in_sequence`) grouped by callee, as
    ``[callee, statements, us, share]`` rows, largest first."""
    total = sum(t for t, _ in timed) or 1.0
    acc: dict[str, list] = {}
    for t, ln in timed:
        row = acc.setdefault(callee(g, ln), [0, 0.0])
        row[0] += 1
        row[1] += t
    return sorted(
        ([name, n, round(t * 1e6, 1), round(t / total, 4)] for name, (n, t) in acc.items()), key=lambda r: -r[2]
    )


def _compiled(kind: str, step):
    """``step`` compiled by ``kind`` ("inductor": torch.compile steady state;
    "torchscript": torch.jit.trace), warmed up; None (printed) if it fails here."""
    try:
        if kind == "inductor":
            fn = torch.compile(step, backend="inductor", dynamic=False)
        else:
            fn = torch.jit.trace(step, (), check_trace=False)
        for _ in range(3):
            fn()
        return fn
    except Exception as exc:  # noqa: BLE001 - a bench reports, it does not fail
        print(f"{kind} unavailable: {type(exc).__name__}: {exc}"[:200])
        return None


def _max_diff_vs_eager(fn, step, set_inputs, caches) -> float:
    """Max abs difference between ``fn()`` and eager ``step()`` on new inputs
    (cache state restored between): 0.0 is bit-exact; a compiled step that
    froze an input or a cache write shows up here rather than as a fast time."""
    set_inputs(6, 2)
    snap = [c.clone() for c in caches]
    got = fn().clone()
    for c, s in zip(caches, snap):
        c.copy_(s)
    ref = step()
    return float((got.double() - ref.double()).abs().max())


def bench_batch(model, batch, reps, inner, tapes, floor=True, inductor=False, torchscript=False):
    """Time eager, a replay per tape module in ``tapes`` (name -> module) and,
    if asked, inductor's and TorchScript's steady state, interleaved (one run
    of each in turn, ``reps`` times, medians); then the kernel floor of the new
    tape's graph (isolated and in sequence), with replay timed right around it."""
    step, set_inputs, caches = BUILDERS[model](batch=batch)
    row = dict(model=model, batch=batch)
    with torch.inference_mode():
        set_inputs(3, 0)
        for _ in range(3):
            step()  # warm up
        graphs = {}
        for name, mod in tapes.items():
            # "python": the new tape with its TorchScript replay engine off
            g = mod.TapeGraph(jit_replay=False) if name == "python" else mod.TapeGraph()
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
            row[f"engine{sfx}"] = getattr(g, "replay_engine", "python")
            row.update(
                {
                    f"bit_exact{sfx}": exact,
                    f"num_ops{sfx}": g.num_ops,
                    f"replayed_ops{sfx}": g.num_replayed_ops,
                    f"capture_ms{sfx}": cap_ms,
                }
            )
        runners = {"eager": step}
        runners.update({name: g.replay for name, g in graphs.items()})
        for kind, asked in (("inductor", inductor), ("torchscript", torchscript)):
            if asked:
                fn = _compiled(kind, step)
                if fn is not None:
                    runners[kind] = fn
                    row[f"{kind}_max_diff"] = _max_diff_vs_eager(fn, step, set_inputs, caches)
                else:
                    row[f"{kind}_us"] = None
        times = {name: [] for name in runners}
        for _ in range(reps):
            for name, fn in runners.items():
                t = _CLOCK()
                for _ in range(inner):
                    fn()
                times[name].append((_CLOCK() - t) / inner)
        if floor:
            # replay timed right around the floors, so that tape/floor compares
            # measurements made under the same machine load
            for name, g in graphs.items():
                if name == "python":
                    continue  # the same program as "new": the same floors
                sfx = "" if name == "new" else f"_{name}"
                near = [_timed(_REPLAY, {"g": g}, inner)]
                fl, per = kernel_floor(g)
                near.append(_timed(_REPLAY, {"g": g}, inner))
                seq, timed = kernel_floor_in_sequence(g)
                near.append(_timed(_REPLAY, {"g": g}, inner))
                row[f"replay_near_floor_us{sfx}"] = statistics.median(near) * 1e6
                row[f"floor_us{sfx}"] = fl * 1e6
                row[f"floor_seq_us{sfx}"] = seq * 1e6
                row[f"floor_top{sfx}"] = [(round(t * 1e6, 2), ln[:80]) for t, ln in per[:5]]
                row[f"profile{sfx}"] = profile_by_callee(g, timed)
    e = statistics.median(times["eager"])
    row["eager_us"] = e * 1e6
    for name in graphs:
        r = statistics.median(times[name])
        sfx = "" if name == "new" else f"_{name}"
        row[f"replay_us{sfx}"] = r * 1e6
        row[f"speedup{sfx}"] = e / r
    for kind in ("inductor", "torchscript"):
        if kind in times:
            row[f"{kind}_us"] = statistics.median(times[kind]) * 1e6
            for name in graphs:
                sfx = "" if name == "new" else f"_{name}"
                row[f"{kind}_over_tape{sfx}"] = row[f"{kind}_us"] / row[f"replay_us{sfx}"]
    # the floor ratios: floor and replay timed by the same clock, next to each other
    for name in graphs:
        sfx = "" if name == "new" else f"_{name}"
        if row.get(f"floor_us{sfx}"):
            # the floor reached by the other runtimes, rescaled to the clock
            # state around the floor (replay_near_floor / replay)
            scale = row[f"replay_near_floor_us{sfx}"] / row[f"replay_us{sfx}"]
            for kind in ("eager", "inductor", "torchscript"):
                if row.get(f"{kind}_us"):
                    row[f"{kind}_over_floor{sfx}"] = row[f"{kind}_us"] * scale / row[f"floor_us{sfx}"]
        if row.get(f"floor_us{sfx}"):
            row[f"tape_over_floor{sfx}"] = row[f"replay_near_floor_us{sfx}"] / row[f"floor_us{sfx}"]
        if row.get(f"floor_seq_us{sfx}"):
            row[f"tape_over_floor_seq{sfx}"] = row[f"replay_near_floor_us{sfx}"] / row[f"floor_seq_us{sfx}"]
    return row


def print_table(rows, baseline: bool):
    print(
        "tape_vs_eager: TapeGraph replay vs eager, per call (llama: the demo decoder; gpt2: a GPT-2-style step; "
        "hf_llama: a transformers Llama; inline: a flat 4-layer decoder function); py: the same graph replayed "
        "by the Python engine"
    )
    head = (
        f"{'model':>8} {'batch':>5} {'eager us':>9} {'replay us':>9} {'speedup':>8} {'exact':>6} {'ops':>4} "
        f"{'replayed':>8} {'capture ms':>10} {'engine':>6} {'py us':>8} {'py/replay':>9}"
    )
    if baseline:
        head += f" {'base us':>8} {'base spd':>8} {'base ops':>8}"
    print(head)
    for r in rows:
        line = (
            f"{r['model']:>8} {r['batch']:>5} {r['eager_us']:>9.1f} {r['replay_us']:>9.1f} {r['speedup']:>7.2f}x "
            f"{str(r['bit_exact']):>6} {r['num_ops']:>4} {r['replayed_ops']:>8} {r['capture_ms']:>10.1f} "
            f"{r.get('engine', '-'):>6} {r.get('replay_us_python', float('nan')):>8.1f} "
            f"{r.get('replay_us_python', float('nan')) / r['replay_us']:>8.2f}x"
        )
        if baseline:
            line += f" {r['replay_us_base']:>8.1f} {r['speedup_base']:>7.2f}x {r['replayed_ops_base']:>8}"
        print(line)
    if any("floor_us" in r or "inductor_us" in r or "torchscript_us" in r for r in rows):
        # against the kernel floor (each replayed op timed alone) and the compilers; the speedup is above
        extra = any("inductor_us" in r or "torchscript_us" in r for r in rows)
        print()
        print(
            f"{'model':>14} {'batch':>5} {'floor us':>9} {'tape/floor':>10} {'tape/seqfl':>10} {'eager/floor':>11}"
            + (
                f" {'inductor/tape':>13} {'script/tape':>11} {'ind/floor':>9} {'ind diff':>8} {'script diff':>11}"
                if extra
                else ""
            )
        )
        fmt = lambda v: f"{v:.2f}" if v else "-"  # noqa: E731
        for r in rows:
            for sfx in ("",) + (("_base",) if baseline else ()):
                if f"speedup{sfx}" not in r or f"floor_us{sfx}" not in r:
                    continue
                line = (
                    f"{r['model'] + (f'({sfx[1:]})' if sfx else ''):>14} {r['batch']:>5} "
                    f"{r['floor_us' + sfx]:>9.1f} "
                    f"{fmt(r.get('tape_over_floor' + sfx)):>10} {fmt(r.get('tape_over_floor_seq' + sfx)):>10} "
                    f"{fmt(r.get('eager_over_floor' + sfx)):>11}"
                )
                if extra:
                    line += (
                        f" {fmt(r.get('inductor_over_tape' + sfx)):>13} "
                        f"{fmt(r.get('torchscript_over_tape' + sfx)):>11} "
                        f"{fmt(r.get('inductor_over_floor' + sfx)):>9} {_sci(r.get('inductor_max_diff')):>8} "
                        f"{_sci(r.get('torchscript_max_diff')):>11}"
                    )
                print(line)


def _sci(v) -> str:
    return "-" if v is None else ("0" if v == 0 else f"{v:.1e}")


def print_profiles(rows, top: int = 10):
    """Where each row's replay time goes (the new tape's in-sequence statement times by callee)."""
    for r in rows:
        prof = r.get("profile")
        if not prof:
            continue
        print(f"\n{r['model']} batch {r['batch']}: replay by callee (in sequence, {r['floor_seq_us']:.0f} us)")
        print(f"{'callee':>28} {'stmts':>5} {'us':>9} {'share':>6}")
        for name, n, us, share in prof[:top]:
            print(f"{name[:28]:>28} {n:>5} {us:>9.1f} {share:>6.1%}")
        rest = prof[top:]
        if rest:
            print(
                f"{'(other)':>28} {sum(x[1] for x in rest):>5} {sum(x[2] for x in rest):>9.1f} "
                f"{sum(x[3] for x in rest):>6.1%}"
            )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("bench", "results", "tape_vs_eager.json"))
    ap.add_argument(
        "--models",
        default="llama,gpt2,hf_llama,inline",
        help="comma list of: llama, gpt2, hf_llama, inline (hf_llama needs transformers)",
    )
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument(
        "--tape",
        default=os.environ.get("GRAPHRUNNER_TAPE_IMPL"),
        help="benchmark this tape.py / tape package directory instead of graphrunner.tape "
        "(default: $GRAPHRUNNER_TAPE_IMPL)",
    )
    ap.add_argument(
        "--baseline", default=None, help="also time replay with this tape.py / tape package directory, interleaved"
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: batches 1,8, 3 reps of 5")
    ap.add_argument("--no-floor", action="store_true", help="skip the kernel floor (each replayed op timed alone)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="print where each replay's time goes, by callee (always in the JSON rows' 'profile')",
    )
    ap.add_argument(
        "--inductor",
        action="store_true",
        help="also time torch.compile (inductor) steady state (compiles once per model and batch)",
    )
    ap.add_argument("--torchscript", action="store_true", help="also time torch.jit.trace of the step")
    ap.add_argument(
        "--clock",
        choices=("auto", "wall", "cpu"),
        default="auto",
        help="cpu: this thread's CPU time (not inflated by other processes on a shared machine; "
        "only meaningful with one thread); wall: perf_counter; auto: cpu when torch uses "
        "one thread, else wall",
    )
    a = ap.parse_args(argv)
    if a.quick:
        a.batches, a.reps, a.inner = "1,8", 3, 5
    if a.threads:
        torch.set_num_threads(a.threads)
    global _CLOCK
    cpu = a.clock == "cpu" or (a.clock == "auto" and torch.get_num_threads() == 1)
    _CLOCK = time.thread_time if cpu else time.perf_counter
    tapes = {"new": load_tape(a.tape)}
    if "jit_replay" in inspect.signature(tapes["new"].TapeGraph).parameters:
        tapes["python"] = tapes["new"]  # the same tape replaying in Python, side by side
    if a.baseline:
        tapes["base"] = load_tape(a.baseline)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in models:
        if m not in BUILDERS:
            ap.error(f"unknown model {m!r} (choose from {', '.join(BUILDERS)})")
    if "hf_llama" in models and importlib.util.find_spec("transformers") is None:
        progress_line("tape_vs_eager: hf_llama skipped: transformers is not installed (pip install -e '.[hf]')")
        models.remove("hf_llama")
    rows = []
    for m in models:
        for b in a.batches.split(","):
            rows.append(
                bench_batch(
                    m,
                    int(b),
                    a.reps,
                    a.inner,
                    tapes,
                    floor=not a.no_floor,
                    inductor=a.inductor,
                    torchscript=a.torchscript,
                )
            )
            progress_line(f"tape_vs_eager: {m} batch {b} done (every field in the JSON's rows)")
    print_table(rows, bool(a.baseline))
    if a.profile:
        print_profiles(rows)
    result = dict(
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        environment=environment(),
        clock="cpu" if cpu else "wall",
        rows=[r for r in rows if r["model"] == "llama"],
        rows_inline=[r for r in rows if r["model"] == "inline"],
        rows_gpt2=[r for r in rows if r["model"] == "gpt2"],
        rows_hf_llama=[r for r in rows if r["model"] == "hf_llama"],
    )
    write_json(a.out, result, announce=True)
    return result


if __name__ == "__main__":
    main()
