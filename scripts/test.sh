#!/usr/bin/env bash
# Set up the environment (scripts/setup.sh) and run the whole test suite on the CPU (what CI runs).
# With arguments, they replace the default target: scripts/test.sh tests/pool/test_layout.py -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
if [ $# -gt 0 ]; then
  "${UNIMEM_VENV:-.venv}/bin/python" -m pytest -q "$@"
else
  "${UNIMEM_VENV:-.venv}/bin/python" -m pytest -q --durations=15 tests
fi
