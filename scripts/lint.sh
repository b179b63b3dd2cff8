#!/usr/bin/env bash
# Lint, format and type checks, as CI runs them before the tests (the versions are pinned by the
# lint extra: pip install -e '.[lint]'). From the repository root: scripts/lint.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -m ruff check .
python -m ruff format --check .
python -m mypy
