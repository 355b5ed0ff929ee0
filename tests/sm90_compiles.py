"""The suite's sm_90 ahead-of-time Triton compiles (CI has no GPU: ``triton.compile`` for
``GPUTarget("cuda", 90, 32)`` needs no driver) run in ONE child process for the whole session: each of
tests/ops/test_fp8_compile.py, test_mla_decode_hopper_compile.py and test_mla_prefill.py registers its child
script when it is imported, and the first test that needs a result runs every registered script, one after
the other, in a single ``python`` without ``TRITON_INTERPRET`` (the test session sets it, and under it the
kernels are interpreter functions) and with a fresh Triton cache (a real compile, not a cache hit). One
launch instead of three saves two interpreter starts with their torch / Triton / unimem_compile imports
(about 3 s of CPU each); every script runs exactly as it ran in its own process, in its own namespace, and
its stdout and any exception come back to its own tests."""

from __future__ import annotations

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

#: seconds the one launch may take (each script had 300-600 s in its own process)
LIMIT_S = 900


def register(name: str, source: str, argv: list[str] | None = None) -> None:
    """Add a child script (run as ``python -c source *argv``) to the session's launch."""
    _SCRIPTS[name] = (source, list(argv or []))


def run(name: str) -> str:
    """The stdout of the registered script ``name``. The first call runs every script registered so far in
    one child process; AssertionError with the script's traceback (and the child's stderr) if it failed."""
    if name not in _RESULTS:
        pending = {k: v for k, v in _SCRIPTS.items() if k not in _RESULTS}
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        with tempfile.TemporaryDirectory(prefix="sm90_triton_cache") as cache:
            env["TRITON_CACHE_DIR"] = cache  # a real compile, not a cache hit
            done = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps(pending), env=env,
                                  capture_output=True, text=True, timeout=LIMIT_S)
        for line in done.stdout.splitlines():
            if line.startswith("SCRIPT "):
                r = json.loads(line[len("SCRIPT "):])
                _RESULTS[r["name"]] = r
        for k in pending:
            _RESULTS.setdefault(k, {"name": k, "stdout": "", "error": f"the child exited with {done.returncode} "
                                                                       f"before this script reported"})
        for k in pending:
            if _RESULTS[k]["error"] is not None:
                _RESULTS[k]["error"] += f"\nthe child's stderr:\n{done.stderr[-4000:]}"
    r = _RESULTS[name]
    assert r["error"] is None, f"compile failed:\n{r['error']}"
    return r["stdout"]


def results(name: str) -> list:
    """The JSON values the registered script ``name`` printed, one per ``RESULT <json>`` line (:func:`run`)."""
    return [json.loads(line[len("RESULT "):]) for line in run(name).splitlines() if line.startswith("RESULT ")]
