"""Which transformers architectures ``gr.hf.DecodeRunner`` accepts, measured on tiny random-weight models.

For every ``model_type`` transformers maps to a causal LM
(``graphrunner_tools.models.hf_tiny.causal_lm_types``), in one process:

1. build it from a tiny config (``build_tiny``; nothing downloaded): failure -> ``build``;
2. the reference: ``model.generate(..., do_sample=False, cache_implementation="static")`` at batch 1
   and 3 (prompt 5, 6 new tokens): failure -> ``no static decode`` (transformers itself cannot);
3. ``DecodeRunner(model, max_batch=4, max_cache_len=16, buckets=[1, 2, 4]).capture()`` (backend
   ``--backend``): a ``CaptureError`` -> ``refused`` with its check (drift, padding, unsafe op,
   self-test, cache layer, known bad, forward failed, ...);
4. ``generate`` at batch 1 and 3 (bucket 4, padded) against the reference: ``accepted`` when every
   token is equal, ``WRONG`` otherwise (the promise is that this never happens).

Generation-config fields whose logits processors DecodeRunner refuses (``forced_eos_token_id`` of the
BART family, ...; ``graphrunner.hf.sampling.unsupported_fields``) are reset on the model before step 2,
for both sides, and recorded: the sweep measures the graphs, not the token chooser.

Each model gets ``--limit`` seconds (SIGALRM; ``timeout``). Prints one line per model and the
counts, writes JSON (``--out``, default ``bench/results/hf_architectures.json``) and, with
``--table FILE``, the Markdown table of docs/architectures.md. Not a test; needs the ``hf`` extra.

    python bench/hf_architectures.py [--only llama,qwen3] [--limit 120] [--threads 1] [--table docs/architectures.md]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import warnings
from collections import Counter
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

#: refusal message fragment -> check name (first match wins)
CHECKS = [
    ("gr.hf.KNOWN_BAD", "known bad"),
    ("differs from the model's own eager decode", "self-test"),
    ("drift between", "drift"),
    ("padding leaks", "padding"),
    ("CaptureUnsafeOpError", "unsafe op"),
    ("cannot be captured", "unsafe op"),
    ("cache layer", "cache layer"),
    ("stayed empty", "ignores the cache"),
    ("cannot build a StaticCache", "no static cache"),
    ("forward over a StaticCache failed", "forward failed"),
]


class _Timeout(Exception):
    pass


def _alarm(_signum, _frame):
    raise _Timeout()


def classify(message: str) -> str:
    """The check a refusal message names."""
    for fragment, name in CHECKS:
        if fragment in message:
            return name
    return "other"


def one(model_type: str, backend: str) -> Dict[str, Any]:
    """Measure one architecture; returns its JSON record."""
    import graphrunner as gr
    from graphrunner_tools.models.hf_tiny import build_tiny

    rec: Dict[str, Any] = {"model_type": model_type}
    try:
        model = build_tiny(model_type)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build tiny
        return {**rec, "status": "build", "reason": f"{type(exc).__name__}: {exc}"[:300]}
    rec["class"] = type(model).__name__
    from graphrunner.hf.sampling import unsupported_fields

    cleared = unsupported_fields(model.generation_config)
    for item in cleared:  # processors DecodeRunner refuses (e.g. forced_eos_token_id): off on both sides
        setattr(model.generation_config, item.split("=")[0], None)
    if cleared:
        rec["generation_config_cleared"] = cleared
    vocab = model.get_input_embeddings().num_embeddings
    prompts = [torch.randint(3, min(vocab, 128), (b, 5), generator=torch.Generator().manual_seed(b)) for b in (1, 3)]
    try:
        with torch.inference_mode():
            want = [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                   cache_implementation="static") for ids in prompts]
    except Exception as exc:  # noqa: BLE001
        return {**rec, "status": "no static decode", "reason": f"{type(exc).__name__}: {exc}"[:300]}
    dr = gr.hf.DecodeRunner(model, max_batch=4, max_cache_len=16, buckets=[1, 2, 4], backend=backend)
    try:
        dr.capture()
    except gr.CaptureError as exc:
        return {**rec, "status": "refused", "check": classify(str(exc)), "reason": str(exc)[:400]}
    got = [dr.generate(ids, max_new_tokens=6) for ids in prompts]
    equal = all(torch.equal(g, w) for g, w in zip(got, want))
    rec.update(status="accepted" if equal else "WRONG", masks="step" if dr.plan.explicit else "model",
               self_test_worst=dr.stats.self_test.worst, replays=dr.stats.replays)
    dr.cleanup()
    return rec


def table(records: List[Dict[str, Any]]) -> str:
    """The Markdown page listing every architecture with its outcome."""
    counts = Counter(r["status"] for r in records)
    built = sum(1 for r in records if r["status"] not in ("build", "no static decode"))
    lines = [
        "# Architectures `gr.hf.DecodeRunner` accepts",
        "",
        "<!-- generated by bench/hf_architectures.py --table docs/architectures.md; do not edit by hand -->",
        "",
        f"Measured on tiny random-weight models (`graphrunner_tools.models.hf_tiny`) of every causal-LM "
        f"`model_type` of transformers {records[0].get('transformers', '')}: "
        f"{counts['accepted']} of {built} that transformers can decode with a static cache are accepted and "
        f"generate token for token what `model.generate(..., cache_implementation=\"static\")` does "
        f"(batch 1 and a padded batch 3); {counts['refused']} are refused at capture with the check that "
        f"failed; {counts['WRONG']} replay wrong. {counts['build']} did not build from a tiny config and "
        f"{counts['no static decode']} cannot decode with transformers' own static cache.",
        "",
        "| model_type | outcome | masks / check | detail |",
        "|---|---|---|---|",
    ]
    for r in records:
        detail = r.get("reason", "")
        if r["status"] == "accepted":
            detail = "bit-exact self-test" if r.get("self_test_worst") == 0.0 else \
                f"self-test within tolerance (max {r.get('self_test_worst', 0):.1e})"
        detail = detail.replace("|", "/").replace("\n", " ")[:160]
        kind = r.get("masks") or r.get("check", "")
        lines.append(f"| {r['model_type']} | {r['status']} | {kind} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated model types (default: all causal LMs)")
    ap.add_argument("--backend", default="full", choices=["full", "breakable"])
    ap.add_argument("--limit", type=int, default=120, help="seconds per architecture")
    ap.add_argument("--out", default="bench/results/hf_architectures.json")
    ap.add_argument("--table", default="", help="also write the Markdown table here")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_error()
    from graphrunner_tools.models.hf_tiny import causal_lm_types

    from graphrunner_tools.bench import environment

    torch.set_num_threads(max(1, args.threads))
    types = [t for t in args.only.split(",") if t] or causal_lm_types()
    signal.signal(signal.SIGALRM, _alarm)
    records = []
    start = time.perf_counter()
    for i, mt in enumerate(types, 1):
        t0 = time.perf_counter()
        signal.alarm(args.limit)
        try:
            rec = one(mt, args.backend)
        except _Timeout:
            rec = {"model_type": mt, "status": "timeout", "reason": f"over {args.limit}s"}
        except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
            rec = {"model_type": mt, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            signal.alarm(0)
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        rec["transformers"] = transformers.__version__
        records.append(rec)
        print(f"[{i}/{len(types)}] {mt}: {rec['status']} {rec.get('check', rec.get('masks', ''))} "
              f"({rec['seconds']}s) {rec.get('reason', '')[:150]}", flush=True)
    counts = Counter(r["status"] for r in records)
    print(f"{len(records)} architectures in {time.perf_counter() - start:.0f}s: "
          + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    print("refusals by check: " + ", ".join(f"{k} {v}" for k, v in
                                             Counter(r.get("check") for r in records if r["status"] == "refused").most_common()))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"backend": args.backend, "threads": args.threads, "environment": environment(),
                   "counts": dict(counts), "records": records}, f, indent=1)
    print(f"wrote {args.out}")
    if args.table:
        with open(args.table, "w") as f:
            f.write(table(records))
        print(f"wrote {args.table}")
    return 1 if counts.get("WRONG") else 0


if __name__ == "__main__":
    sys.exit(main())
