#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv (or $UNIMEM_VENV) and install unimem-compile into it
# with the pinned CI versions. torch's CPU build is installed first when no torch is present: an unpinned
# torch would resolve to a multi-GB CUDA build.   usage: scripts/setup.sh [extras]   (e.g. "test")
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${UNIMEM_VENV:-$root/.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$venv/bin/python" -c "import torch" 2>/dev/null || "$venv/bin/pip" install -q torch==2.13.0
extras=${1:-}
"$venv/bin/pip" install -q -c "$root/constraints/ci.txt" -e "$root${extras:+[$extras]}"
