#!/usr/bin/env bash
# cuda-check: everything graphrunner checks that needs a GPU, in one bounded run (< 8 min).
#
#   scripts/cuda-check.sh            # from anywhere; works from the repository root it lives in
#   OUT=/some/dir scripts/cuda-check.sh
#
# Steps (each with its own time limit, all under one overall deadline):
#   1. install: `pip install --no-deps --no-build-isolation -e .` (offline) when torch, pytest
#      and matplotlib are already importable, else `pip install -e '.[test,bench]'` (pulls torch in
#      when missing; needs the network). The repository is on PYTHONPATH regardless, so a failed
#      install is reported, not fatal
#   2. check `torch.cuda.is_available()`; without CUDA: a clear message, summary, exit 2
#   3. python -m pytest -m cuda
#   4. graphrunner demo --device cuda --backend breakable, and --backend full
#   5. graphrunner bench (writes bench.json and latency_vs_batch.png under $OUT/bench)
# Writes $OUT/summary.txt (default ./cuda-check-out/summary.txt, relative to where it is run) and one log per step next to it.
# Exit status: 0 when every step passed, 1 when a step failed or timed out, 2 without CUDA.
#
# Environment: OUT (output dir), PYTHON (interpreter, default python3 or python),
# CUDA_CHECK_SKIP_INSTALL=1 (skip step 1), CUDA_CHECK_BUDGET_S (overall deadline, default 450).
set -uo pipefail

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
START=$SECONDS
FAILED=0
: >"$SUMMARY"

say() { echo "$*" | tee -a "$SUMMARY"; }
remaining() { echo $(( BUDGET_S - (SECONDS - START) )); }

# run_step NAME LIMIT_S CMD...: run with a time limit (capped by the overall deadline),
# log to $OUT_DIR/NAME.log, record PASS/FAIL/TIMEOUT with the duration and the log's tail.
run_step() {
  local name="$1" limit="$2"; shift 2
  local left; left=$(remaining)
  if [ "$left" -lt 10 ]; then
    say "SKIP    $name (overall budget of ${BUDGET_S}s spent)"; FAILED=1; return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local log="$OUT_DIR/$name.log" t0=$SECONDS rc
  echo "--- $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  local dt=$(( SECONDS - t0 ))
  if [ "$rc" -eq 0 ]; then
    say "PASS    $name (${dt}s)"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    say "TIMEOUT $name after ${dt}s (limit ${limit}s), log: $log"; FAILED=1
  else
    say "FAIL    $name (exit $rc, ${dt}s), log: $log"; FAILED=1
  fi
  if [ "$rc" -ne 0 ]; then
    tail -n 15 "$log" | sed 's/^/        | /' | tee -a "$SUMMARY"
  fi
  return "$rc"
}

say "graphrunner cuda-check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), repo $REPO"
say "python: $(command -v "$PYTHON") ($("$PYTHON" --version 2>&1))"

# 1. install. With torch, pytest and matplotlib already importable, install the package alone
# offline (no build isolation: nothing is downloaded); otherwise the full install with its
# extras, which needs the network. An install failure is reported, not fatal: the repository
# is on PYTHONPATH and every step runs `python -m ...`.
if [ "${CUDA_CHECK_SKIP_INSTALL:-0}" != "1" ]; then
  if "$PYTHON" -c 'import torch' >/dev/null 2>&1; then
    say "torch already installed: $("$PYTHON" -c 'import torch; print(torch.__version__)' 2>&1)"
  else
    say "torch is not installed: pip installs it as a dependency (the default PyPI wheel on Linux has CUDA)"
  fi
  SAVED_FAILED=$FAILED
  if "$PYTHON" -c 'import torch, pytest, matplotlib, setuptools' >/dev/null 2>&1; then
    run_step install 120 "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation -e . \
      || say "WARN    package not installed; running from $REPO on PYTHONPATH instead"
  else
    run_step install 240 "$PYTHON" -m pip install --quiet -e '.[test,bench]' \
      || say "WARN    install failed (no network?); running from $REPO on PYTHONPATH with what is installed"
  fi
  FAILED=$SAVED_FAILED
fi
"$PYTHON" -c 'import pytest' >/dev/null 2>&1 || say "WARN    pytest is not importable: the cuda tests step will fail"
"$PYTHON" -c 'import matplotlib' >/dev/null 2>&1 || say "WARN    matplotlib is not importable: the bench step skips its plot"

# 2. CUDA?
CUDA_INFO="$("$PYTHON" -c 'import torch; print(torch.cuda.is_available()); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")' 2>&1)"
CUDA_OK="$(echo "$CUDA_INFO" | head -n 1)"
say "torch: $(echo "$CUDA_INFO" | tail -n +2)"
if [ "$CUDA_OK" != "True" ]; then
  say "CUDA is NOT available to PyTorch here (torch.cuda.is_available() printed: $(echo "$CUDA_INFO" | head -n 3 | tr '\n' ' '))."
  say "Nothing to check: run this on a machine with an NVIDIA GPU, its driver, and a CUDA build of PyTorch"
  say "(e.g. pip install torch from https://download.pytorch.org/whl/cu124). The CPU test suite is 'python -m pytest'."
  echo "summary: $SUMMARY"
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /' | tee -a "$SUMMARY"

# 3-5. the checks
run_step pytest-cuda 150 "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider
run_step demo-breakable 45 "$PYTHON" -m graphrunner_tools.cli demo --device cuda --backend breakable
run_step demo-full 45 "$PYTHON" -m graphrunner_tools.cli demo --device cuda --backend full
# Last, so it gets what is left of the budget; bench.json is rewritten after every script.
run_step bench 300 "$PYTHON" -m graphrunner_tools.bench --out "$OUT_DIR/bench/bench.json" \
  --plot "$OUT_DIR/bench/latency_vs_batch.png"

# Headline numbers of the bench into the summary: its own summary block, or, when it was cut
# short, what bench.json holds (it is rewritten after every benchmark script).
if [ -f "$OUT_DIR/bench.log" ] && grep -q '\[bench\] summary' "$OUT_DIR/bench.log"; then
  sed -n '/\[bench\] summary/,$p' "$OUT_DIR/bench.log" >>"$SUMMARY"
elif [ -f "$OUT_DIR/bench/bench.json" ]; then
  "$PYTHON" - "$OUT_DIR/bench/bench.json" >>"$SUMMARY" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("[bench] partial results: finished", sorted(d.get("results", {})), "errors", sorted(d.get("errors", {})))
print(json.dumps(d.get("summary", {}), indent=1))
PY
fi
grep -E "passed|failed|skipped|error" "$OUT_DIR/pytest-cuda.log" 2>/dev/null | tail -n 1 | sed 's/^/pytest -m cuda: /' \
  | tee -a "$SUMMARY"

say "total $(( SECONDS - START ))s; result: $([ "$FAILED" -eq 0 ] && echo ALL PASSED || echo FAILURES)"
echo "summary: $SUMMARY"
exit "$FAILED"
