#!/usr/bin/env bash
# Set up the environment (scripts/setup.sh) and run the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
"${UNIMEM_VENV:-.venv}/bin/python" -m pytest -q tests "$@"
