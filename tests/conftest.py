"""Test-process setup. Triton decides interpreter vs compiled when a kernel module is imported, so the
interpreter is switched on here (on machines without CUDA), before anything imports unimem_compile
(docs/design.md section 4)."""

import logging
import os

import pytest
import torch

# On a CPU machine every Triton kernel runs in the interpreter; on a GPU machine (tests/gpu) they compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# pytest attaches its log capture to every logger that does not propagate, and torch's structured trace log
# ("torch.__trace", always at DEBUG) is one: every graph torch.compile traces was then formatted into the
# captured report (a 3-compile fixture took 147 s instead of 29 s). That log is for TORCH_TRACE runs,
# which the tests never make.
logging.getLogger("torch.__trace").addFilter(lambda record: False)


@pytest.fixture
def gen():
    """A seeded torch.Generator: random inputs that are reproducible per test."""
    g = torch.Generator().manual_seed(1234)
    return g
