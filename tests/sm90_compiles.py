"""The suite's sm_90 ahead-of-time Triton compiles (CI has no GPU: ``triton.compile`` for
``GPUTarget("cuda", 90, 32)`` needs no driver) run once per session, in child processes: each of
tests/ops/test_fp8_compile.py, test_mla_decode_hopper_compile.py, test_mla_decode_smem.py and
test_mla_prefill.py registers its child script when it is imported, and the first test that needs a result
runs every registered script, dealt out over ``os.cpu_count()`` children (each runs its share one after the
other), without ``TRITON_INTERPRET`` (the test session sets it, and under it the kernels are interpreter
functions) and with a fresh Triton cache (a real compile, not a cache hit). The compiles are single-threaded
and the test process only waits for them, so on CI's 2 cores two children cut the wait (2026-12-02, this
2-core machine: 175 s for the four scripts in one child, 107 s in two); one child per core, not per script,
keeps the interpreter starts with their torch / Triton / unimem_compile imports (about 3 s of CPU each) to
one per core. Every script runs exactly as it would alone, in its own namespace, and its stdout and any
exception come back to its own tests."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile

#: name -> (the child script's source, its sys.argv[1:])
_SCRIPTS: dict[str, tuple[str, list[str]]] = {}
_RESULTS: dict[str, dict] = {}

_DRIVER = r'''
import contextlib, io, json, sys, traceback
scripts = json.loads(sys.stdin.read())
for name, (source, argv) in scripts.items():
    out, error = io.StringIO(), None
    sys.argv = ["-c", *argv]
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, "<" + name + ">", "exec"), {"__name__": "__main__"})
    except BaseException:
        error = traceback.format_exc()
    print("SCRIPT " + json.dumps({"name": name, "stdout": out.getvalue(), "error": error}), flush=True)
'''

#: seconds one child may take (each script had 300-600 s in its own process before they shared children)
LIMIT_S = 900


def register(name: str, source: str, argv: list[str] | None = None) -> None:
    """Add a child script (run as ``python -c source *argv``) to the session's launch."""
    _SCRIPTS[name] = (source, list(argv or []))


def _launch(scripts: dict) -> list[dict]:
    """Run registered scripts one after the other in one child process; their ``{"name", "stdout", "error"}``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory(prefix="sm90_triton_cache") as cache:
        env["TRITON_CACHE_DIR"] = cache  # a real compile, not a cache hit
        done = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps(scripts), env=env,
                              capture_output=True, text=True, timeout=LIMIT_S)
    reported = {}
    for line in done.stdout.splitlines():
        if line.startswith("SCRIPT "):
            r = json.loads(line[len("SCRIPT "):])
            reported[r["name"]] = r
    out = []
    for name in scripts:
        r = reported.get(name) or {"name": name, "stdout": "",
                                   "error": f"the child exited with {done.returncode} before this script reported"}
        if r["error"] is not None:
            r["error"] += f"\nthe child's stderr:\n{done.stderr[-4000:]}"
        out.append(r)
    return out


def run(name: str) -> str:
    """The stdout of the registered script ``name``. The first call runs every script registered so far, in
    ``os.cpu_count()`` child processes (the scripts dealt out in registration order); AssertionError with the
    script's traceback (and its child's stderr) if it failed."""
    if name not in _RESULTS:
        pending = list(_SCRIPTS.items())
        pending = [(k, v) for k, v in pending if k not in _RESULTS]
        workers = max(1, min(len(pending), os.cpu_count() or 1))
        groups = [dict(pending[i::workers]) for i in range(workers)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            for reports in pool.map(_launch, groups):
                for r in reports:
                    _RESULTS[r["name"]] = r
    r = _RESULTS[name]
    assert r["error"] is None, f"compile failed:\n{r['error']}"
    return r["stdout"]


def results(name: str) -> list:
    """The JSON values the registered script ``name`` printed, one per ``RESULT <json>`` line (:func:`run`)."""
    return [json.loads(line[len("RESULT "):]) for line in run(name).splitlines() if line.startswith("RESULT ")]
