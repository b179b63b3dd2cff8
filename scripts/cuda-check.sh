#!/usr/bin/env bash
# cuda-check: everything graphrunner checks that needs a GPU, in one bounded run (< 8 min on one GPU).
#
#   scripts/cuda-check.sh              # on a GPU machine, with whatever CUDA torch is installed
#   scripts/cuda-check.sh --dry-run    # the same steps on the CUDA stand-in (graphrunner.testing.cuda_standin), CPU only
#   OUT=/some/dir scripts/cuda-check.sh
#
# Nothing is installed and nothing is downloaded: the repository is put on PYTHONPATH and every step
# runs `python -m ...` with what is importable (torch, pytest; transformers optional).
# Steps (each with its own time limit, all under one overall deadline of CUDA_CHECK_BUDGET_S, default 450 s):
#   pytest-cuda        python -m pytest -m cuda (on the stand-in in --dry-run: the tests taking `cuda_device`)
#   perf               full and breakable graph vs eager per call at batch 1/8/32: CUDA-event device time,
#                      host time per call, bit-exactness
#   memory             reserved memory per bucket, after cleanup and after empty_cache
#   defects            the issue-23 scenarios, one process each (empty first segment, debug_eager, reset and
#                      re-capture, retry after a failed capture, sync in capture -> "restart", gloo collective
#                      in capture -> CaptureError, empty full graph -> error, one GPU per rank)
#   demo               graphrunner demo --device cuda --backend breakable
#   loadtest           graphrunner loadtest --device cuda (decode steps, breakable)
#   loadtest-spec      graphrunner loadtest --device cuda --spec 3 --backend full (verify steps)
#   verify             graphrunner verify (its graphs are tape graphs on the CPU: the command has no --device)
#   loadtest-ranks     graphrunner loadtest --device cuda --ranks N, N = the GPU count (its largest power of two)
#                      when it is 2 or more: N NCCL processes, one GPU each, the tensor-parallel all_reduce captured
#                      inside the step, every token equal to the eager engine's (SKIP with one GPU, and in
#                      --dry-run: the stand-in has no NCCL)
#   loadtest-ranks-refused  --ranks (GPU count + 1): refused before any rank starts ("needs N GPUs, one per rank")
#   hf                 gr.hf.DecodeRunner on llama, qwen2, mistral, bart (tiny random models; bart's own forced
#                      EOS greedy and sampled, llama with a repetition penalty) vs model.generate;
#                      skipped without transformers
#   hf-batching        bench/hf_continuous_batching.py --quick --only llama --device cuda: transformers'
#                      continuous batching through gr.hf.generate_batch's graphs, every token equal to its
#                      eager run (exit 1 on a mismatch), tokens/s side by side; skipped without transformers
#                      and in --dry-run (transformers' engine pins host memory, which the stand-in cannot)
# Writes $OUT/<step>.json (the Python checks), $OUT/<step>.log, $OUT/summary.txt (one line per step) and
# $OUT/summary.json. Exit status: 0 when every step passed, 1 when one failed or timed out, 2 without CUDA
# (and without --dry-run).
# Environment: OUT (default ./cuda-check-out), PYTHON (default python3 or python), CUDA_CHECK_BUDGET_S.
set -uo pipefail

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
    *) echo "cuda-check: unknown argument $arg (expected --dry-run)" >&2; exit 2 ;;
  esac
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$PWD/cuda-check-out}"
mkdir -p "$OUT_DIR" || exit 1
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$REPO" || exit 1
SUMMARY="$OUT_DIR/summary.txt"
BUDGET_S="${CUDA_CHECK_BUDGET_S:-450}"
if [ -z "${PYTHON:-}" ]; then
  if command -v python3 >/dev/null 2>&1; then PYTHON=python3; else PYTHON=python; fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export OUT="$OUT_DIR"
START=$SECONDS
FAILED=0
: >"$SUMMARY"
echo "[" >"$OUT_DIR/summary.json.tmp"

say() { echo "$*" | tee -a "$SUMMARY"; }
remaining() { echo $(( BUDGET_S - (SECONDS - START) )); }
record() {  # name status seconds detail
  local d="${4//\\/\\\\}"; d="${d//\"/\\\"}"
  echo "{\"step\": \"$1\", \"status\": \"$2\", \"seconds\": $3, \"detail\": \"$d\"}," >>"$OUT_DIR/summary.json.tmp"
}
skip_step() {  # name why: a step that does not run here, said in the summary and the JSON (not a failure)
  say "$(printf '%-7s %-16s %4ss  %s' SKIP "$1" 0 "$2")"
  record "$1" SKIP 0 "$2"
}

# run_step NAME LIMIT_S [EXPECT_REGEX] -- CMD...: run with a time limit (capped by the overall deadline), log to
# $OUT_DIR/NAME.log, one summary line: PASS/FAIL/TIMEOUT, the duration, and the step's own summary line (the
# last line starting with PASS/FAIL, or the log's last line). With EXPECT_REGEX the step passes when the log
# matches it (an expected failure), whatever the exit status.
run_step() {
  local name="$1" limit="$2" expect=""; shift 2
  if [ "$1" != "--" ]; then expect="$1"; shift; fi
  shift  # --
  local left; left=$(remaining)
  if [ "$left" -lt 10 ]; then
    say "SKIP    $name (overall budget of ${BUDGET_S}s spent)"; record "$name" SKIP 0 "budget spent"; FAILED=1; return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local log="$OUT_DIR/$name.log" t0=$SECONDS rc status detail
  echo "--- $name (limit ${limit}s): $*" >&2
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  local dt=$(( SECONDS - t0 ))
  detail="$(grep -E '^(PASS|FAIL) ' "$log" | tail -n 1)"
  [ -z "$detail" ] && detail="$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-300)"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status=TIMEOUT; FAILED=1
  elif [ -n "$expect" ]; then
    if grep -Eq "$expect" "$log"; then status=PASS; detail="expected outcome: $(grep -Eo "$expect" "$log" | head -n 1)"
    elif [ "$rc" -eq 0 ]; then status=PASS; detail="ran to completion (exit 0)"
    else status=FAIL; FAILED=1; fi
  elif [ "$rc" -eq 0 ]; then
    status=PASS
  else
    status=FAIL; FAILED=1
  fi
  say "$(printf '%-7s %-16s %4ss  %s' "$status" "$name" "$dt" "$detail")"
  record "$name" "$status" "$dt" "$detail"
  if [ "$status" != PASS ]; then tail -n 12 "$log" | sed 's/^/        | /' | tee -a "$SUMMARY"; fi
  return 0
}

MODE="GPU"
if [ "$DRY_RUN" -eq 1 ]; then
  MODE="dry run on the CUDA stand-in (CPU; timings are the CPU's)"
  export GRAPHRUNNER_CUDA_STANDIN=1
  CLI=("$PYTHON" -m graphrunner.testing.cuda_standin graphrunner_tools)
else
  CLI=("$PYTHON" -m graphrunner_tools)
fi
say "graphrunner cuda-check ($MODE) $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), repo $REPO, out $OUT_DIR"
say "python: $(command -v "$PYTHON") ($("$PYTHON" --version 2>&1)); $("$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1)"

if [ "$DRY_RUN" -eq 0 ]; then
  CUDA_OK="$("$PYTHON" -c 'import torch; print(torch.cuda.is_available())' 2>&1 | tail -n 1)"
  if [ "$CUDA_OK" != "True" ]; then
    say "CUDA is NOT available to PyTorch here (torch.cuda.is_available() printed: $CUDA_OK)."
    say "Run this on a machine with an NVIDIA GPU and a CUDA build of PyTorch, or use --dry-run (the CUDA stand-in)."
    echo "summary: $SUMMARY"
    exit 2
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /' | tee -a "$SUMMARY"
fi
"$PYTHON" -c 'import pytest' >/dev/null 2>&1 || say "WARN    pytest is not importable: the pytest-cuda step will fail"

# The pytest step runs without the stand-in variable: the cuda tests install the stand-in themselves
# (fixture cuda_device) where there is no GPU, and the variable would reach the processes they spawn.
run_step pytest-cuda 120 -- env -u GRAPHRUNNER_CUDA_STANDIN "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider \
  --junitxml "$OUT_DIR/pytest-cuda.xml"
run_step perf 120 -- "$PYTHON" -m graphrunner_tools.cuda_check perf --out "$OUT_DIR"
run_step memory 45 -- "$PYTHON" -m graphrunner_tools.cuda_check memory --out "$OUT_DIR"
run_step defects 120 -- "$PYTHON" -m graphrunner_tools.cuda_check defects --out "$OUT_DIR"
run_step demo 45 -- "${CLI[@]}" demo --device cuda --backend breakable --steps 40 \
  --trace-out "$OUT_DIR/demo-trace"
run_step loadtest 60 -- "${CLI[@]}" loadtest --device cuda --backend breakable --requests 16 --concurrency 4 \
  --layers 1 --no-progress --json "$OUT_DIR/loadtest.json"
run_step loadtest-spec 60 -- "${CLI[@]}" loadtest --device cuda --backend full --spec 3 --requests 8 \
  --concurrency 4 --layers 1 --no-progress --json "$OUT_DIR/loadtest-spec.json"
run_step verify 45 -- "${CLI[@]}" verify --requests 3 --max-new 6 --layers 1 --no-progress
# GPUs and NCCL as the loadtest will see them (in --dry-run: the stand-in's devices, a CPU torch without NCCL)
read -r GPUS NCCL < <("$PYTHON" -c 'import torch, torch.distributed as d
from graphrunner.testing.cuda_standin import install_from_env
install_from_env()
print(torch.cuda.device_count(), int(d.is_available() and d.is_nccl_available()))' 2>/dev/null || echo "0 0")
RANKS=1; while [ $(( RANKS * 2 )) -le "${GPUS:-0}" ]; do RANKS=$(( RANKS * 2 )); done  # the decoder splits by 2^k
if [ "$RANKS" -ge 2 ] && [ "${NCCL:-0}" -eq 1 ]; then
  run_step loadtest-ranks 90 -- "${CLI[@]}" loadtest --device cuda --ranks "$RANKS" --requests 8 --concurrency 2,4 \
    --layers 1 --no-progress --json "$OUT_DIR/loadtest-ranks.json"
else
  WHY="needs 2 or more GPUs and NCCL; here $GPUS GPU(s), NCCL $([ "${NCCL:-0}" -eq 1 ] && echo yes || echo no)"
  skip_step loadtest-ranks "$WHY"
fi
MORE=$(( ${GPUS:-0} + 1 ))
run_step loadtest-ranks-refused 60 "needs $MORE GPUs, one per rank" -- "${CLI[@]}" loadtest --device cuda \
  --ranks "$MORE" --requests 4 --concurrency 2 --layers 1 --no-progress
run_step hf 90 -- "$PYTHON" -m graphrunner_tools.cuda_check hf --out "$OUT_DIR"
if [ "$DRY_RUN" -eq 1 ]; then  # transformers' engine pins host memory for a CUDA model: the stand-in has no pinned allocator
  WHY="GPU only: transformers' continuous batching pins host memory on CUDA, which the stand-in cannot emulate"
  skip_step hf-batching "$WHY"
elif "$PYTHON" -c 'import transformers' >/dev/null 2>&1; then
  run_step hf-batching 120 -- "$PYTHON" bench/hf_continuous_batching.py --quick --only llama --repeat 1 \
    --device cuda --out "$OUT_DIR/hf_continuous_batching.json"
else
  skip_step hf-batching "transformers is not installed"
fi

grep -E "passed|failed|skipped|error" "$OUT_DIR/pytest-cuda.log" 2>/dev/null | tail -n 1 | sed 's/^/pytest -m cuda: /' \
  | tee -a "$SUMMARY"
TOTAL=$(( SECONDS - START ))
RESULT="$([ "$FAILED" -eq 0 ] && echo "ALL PASSED" || echo FAILURES)"
say "total ${TOTAL}s ($MODE); result: $RESULT"
{ cat "$OUT_DIR/summary.json.tmp"; echo "{\"step\": \"total\", \"status\": \"$RESULT\", \"seconds\": $TOTAL, \"detail\": \"$MODE\"}"; echo "]"; } \
  >"$OUT_DIR/summary.json" && rm -f "$OUT_DIR/summary.json.tmp"
echo "summary: $SUMMARY"
exit "$FAILED"
