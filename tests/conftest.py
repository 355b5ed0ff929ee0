"""Test-process setup. Triton decides interpreter vs compiled when a kernel module is imported, so the
interpreter is switched on here (on machines without CUDA), before anything imports unimem_compile
(docs/design.md section 4)."""

import os

import pytest
import torch

# On a CPU machine every Triton kernel runs in the interpreter; on a GPU machine (tests/gpu) they compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def gen():
    """A seeded torch.Generator: random inputs that are reproducible per test."""
    g = torch.Generator().manual_seed(1234)
    return g
