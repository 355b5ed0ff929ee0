"""The suite's Inductor compiles (C++ codegen on the CPU, the slowest thing CI does): one per model family,
built once per test session by whichever module asks first. tests/hf/test_inductor.py (tokens, graphs, the
prefill code), tests/passes/test_state_rewrites_inductor.py (the state writes in the generated code) and the
warm-cache test of tests/passes/test_mla_passes.py read the same run. Every call of the compiled model is
made here and its result recorded, so what a test reads does not depend on which test ran first."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch._inductor.utils import run_and_get_code

import unimem_compile
from unimem_compile.hf.models import build_model

from .hf.generate_models import greedy, prompts

MAX_BATCH, MAX_SEQ, PAGE = 2, 96, 16
LENGTHS, SEED, NEW_TOKENS = (24, 17), 21, 20
#: 10 + 10 + 4: a chunked prefill of the longest prompt
CHUNK = 10


@dataclasses.dataclass(frozen=True)
class InductorRun:
    """One family compiled with ``backend="inductor"`` and every pass (max_batch_size MAX_BATCH, max_seq_len
    MAX_SEQ, page PAGE), and what its calls returned.

    Attributes:
        model: the compiled model, as the calls below left it (tests read it, never call it).
        ids, mask: the left-padded prompts, int64 ``[2, 24]`` (lengths LENGTHS, vocab 1024).
        want: stock transformers' greedy tokens, int64 ``[2, 24 + NEW_TOKENS]``.
        got: the first greedy generate(), which compiled every graph.
        codes: the generated code of every graph that generate() compiled (Inductor hands it over on a
            cache miss and on an FX / AOTAutograd cache hit alike: torch 2.13 ``cache_hit_post_compile``).
        graphs_first: graphs the pass manager had seen after that first generate().
        rewrites_first: ``model.unimem.rewrites`` after it (a copy: per rewrite, sites rewritten).
        counts: the rewrite counts per graph (``GraphRecord.counts``), in compile order.
        again: a second greedy generate(), same call.
        chunked: the same call with ``prefill_chunk_size=CHUNK``.
        graphs_last: graphs the pass manager had seen after all three.
        stats: ``model.unimem.stats()`` after all three.
    """

    model: torch.nn.Module
    ids: torch.Tensor
    mask: torch.Tensor
    want: torch.Tensor
    got: torch.Tensor
    codes: list[str]
    graphs_first: int
    rewrites_first: dict
    counts: list[dict]
    again: torch.Tensor
    chunked: torch.Tensor
    graphs_last: int
    stats: dict


def _compile(family: str):
    model = build_model(family)
    unimem_compile.compile(model, max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ, page_size=PAGE, backend="inductor")
    model.unimem.passes.keep_graphs = True
    return model


@functools.cache
def inductor_run(family: str) -> InductorRun:
    """:class:`InductorRun` of ``family`` (a preset of :mod:`unimem_compile.hf.models`), once per session."""
    ids, mask = prompts(LENGTHS, SEED)
    want = greedy(build_model(family), ids, mask, NEW_TOKENS)
    model = _compile(family)
    got, codes = run_and_get_code(greedy, model, ids, mask, NEW_TOKENS)
    graphs_first, rewrites_first = model.unimem.passes.graphs, dict(model.unimem.rewrites)
    counts = [dict(r.counts) for r in model.unimem.passes.records]
    again = greedy(model, ids, mask, NEW_TOKENS)
    chunked = greedy(model, ids, mask, NEW_TOKENS, prefill_chunk_size=CHUNK)
    return InductorRun(model, ids, mask, want, got, codes, graphs_first, rewrites_first, counts, again, chunked,
                       model.unimem.passes.graphs, model.unimem.stats())


@dataclasses.dataclass(frozen=True)
class WarmRun:
    """The family compiled again after :func:`inductor_run` and a Dynamo reset: its Inductor graphs come from
    the compile cache that run filled.

    Attributes:
        hits: FX-graph plus AOTAutograd cache hits counted during this compile.
        counters: a copy of Dynamo's counters after it (for the failure message).
        rewrites, counts, tokens: as :class:`InductorRun`'s ``rewrites_first``, ``counts``, ``got``.
    """

    hits: int
    counters: dict
    rewrites: dict
    counts: list[dict]
    tokens: torch.Tensor


@functools.cache
def warm_run(family: str) -> WarmRun:
    """:class:`WarmRun` of ``family``, once per session. It resets Dynamo, so every model compiled before it
    recompiles on its next call: only tests that reset Dynamo themselves call it."""
    run = inductor_run(family)
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    model = _compile(family)
    tokens = greedy(model, run.ids, run.mask, NEW_TOKENS)
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    return WarmRun(hits, {k: dict(v) for k, v in counters.items()}, dict(model.unimem.rewrites),
                   [dict(r.counts) for r in model.unimem.passes.records], tokens)
