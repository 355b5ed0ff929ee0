#!/usr/bin/env bash
# Set up the environment (scripts/setup.sh) and run the main job on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
"${UNIMEM_VENV:-.venv}/bin/unimem-compile" demo "$@"
