"""What the tests/hf/test_generate_*.py modules share: the compiled models (each built once per test session,
whichever module asks first, so splitting the tests by concern compiles no more models than one module
did), prompts and the greedy / sampled generate() calls compared with stock transformers."""

import functools

import torch

import unimem_compile
from unimem_compile.hf.models import build_model

from ..prompts import left_padded

FAMILIES = ["kimi-linear-tiny", "deepseek-v3-tiny"]
MAX_SEQ = 160
PAGE = 16


@functools.cache
def compiled_pair(family: str):
    """(stock model, unimem-compiled model with the same weights, family name), aot_eager inner backend;
    max_batch_size 4, max_seq_len MAX_SEQ, page PAGE."""
    stock = build_model(family)
    model = build_model(family)
    unimem_compile.compile(model, max_batch_size=4, max_seq_len=MAX_SEQ, page_size=PAGE, backend="aot_eager")
    return stock, model, family


@functools.cache
def compiled_small():
    """A compiled kimi-linear-tiny for the refusal and lifecycle tests: max_batch_size 2, max_seq_len 32,
    page 8, aot_eager."""
    model = build_model("kimi-linear-tiny")
    return unimem_compile.compile(model, max_batch_size=2, max_seq_len=32, page_size=8, backend="aot_eager")


def prompts(lengths, seed, vocab=1024):
    """Left-padded random prompts of the given lengths, from a generator seeded with ``seed``."""
    return left_padded(lengths, torch.Generator().manual_seed(seed), vocab)



def greedy(model, ids, mask, new_tokens, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, **kw)



def sampled(stock, model, ids, mask, seed, **kw):
    """(stock tokens, compiled-model tokens) of one sampled generate() each, from the same torch seed. The
    compiled model runs transformers' own decode loop (``use_runner = False``): the decode runner's draws
    follow the same distribution but are not stock's (tests/hf/test_generate_runner.py)."""
    out = []
    model.unimem.use_runner = False
    try:
        for m in (stock, model):
            torch.manual_seed(seed)
            with torch.no_grad():
                out.append(m.generate(ids, attention_mask=mask, do_sample=True, **kw))
    finally:
        model.unimem.use_runner = True
    return out

