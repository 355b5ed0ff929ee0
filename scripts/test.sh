#!/usr/bin/env bash
# Set up the environment (scripts/setup.sh) and run the whole test suite on the CPU (what CI runs).
# With arguments, they replace the default target: scripts/test.sh tests/pool/test_layout.py -x
# The whole suite runs in UNIMEM_TEST_WORKERS pytest-xdist workers (default 2, CI's cores; 1 runs it in this
# process), each test file on one worker (--dist loadfile: a module's shared compiled models are built once; each
# worker keeps tests/conftest.py's two intra-op threads): most of the suite's time is single-threaded compilation,
# so two workers on two cores take ~0.65x the time of one process (2026-12-03: 1,251 s vs ~1,940 s).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
if [ $# -gt 0 ]; then
  "${UNIMEM_VENV:-.venv}/bin/python" -m pytest -q "$@"
else
  workers=${UNIMEM_TEST_WORKERS:-2}
  if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
    echo "UNIMEM_TEST_WORKERS must be an integer >= 1, got '$workers'" >&2
    exit 2
  fi
  if [ "$workers" -gt 1 ]; then
    "${UNIMEM_VENV:-.venv}/bin/python" -m pytest -q -n "$workers" --dist loadfile --durations=15 tests
  else
    "${UNIMEM_VENV:-.venv}/bin/python" -m pytest -q --durations=15 tests
  fi
fi
