"""Serving: continuous batching on the unified arena vs static splits of the same budget, on a real stream.

Model ``kimi-linear-48b-8l`` (8 layers, 2 MLA + 6 KDA, the real per-layer geometry), bf16, random weights,
an arena of 6 GiB so that memory binds. Requests arrive in wall-clock time from a seeded trace (defined
below); the engine serves them through ``model.init_continuous_batching`` (its background loop), the
benchmark's main thread adding each request at its arrival time. Every request runs to its output length
(``min_new_tokens = max_new_tokens``: random weights would otherwise end at a random EOS).

Traces (seed ``--seed``, :func:`chat_lengths`, :func:`long_lengths`):

* chat: prompt lognormal (median 1024 tokens, sigma 1.0, clipped to 64..8192), output lognormal (median 128,
  sigma 0.7, clipped to 16..512);
* long-context: prompt log-uniform 16k..96k tokens, output 128;
* stationary: 3000 requests, Poisson arrivals at ``--rate`` requests/s, each long-context with probability 2%;
* phased: 1500 chat requests (Poisson, ``--rate``), then 60 long-context requests arriving uniformly over
  5% of the trace's duration, then 1500 chat requests.

``--scale f`` keeps the first ``f`` of each phase's requests and compresses nothing: the arrival rate is the
same, so durations shrink in proportion. Arrival rate rule: the highest at which the unified engine keeps its
queue bounded on the stationary trace (``--find-rate``: a bisection over short stationary runs, each stopped
at its last arrival; bounded = the queue in the last quarter of the arrivals never exceeds its peak over the
first three quarters plus 8); every system then gets that same rate, passed as ``--rate``.

Systems (``--systems``, comma-separated; same budget, same process, same kernels): ``unified`` (the arena
shared by KV pages and state slots), ``static0.25`` / ``static0.5`` / ``static0.75`` (the same engine with
the budget split in advance: KV pages may use that share, state slots the rest), ``simbest`` (the static
split the capacity simulator finds best for the trace: it runs the simulator's grid over the trace first and
reports the share), ``stock_cb`` (stock transformers ``generate_batch`` on the same model, uncompiled: its
error is recorded), ``stock_static`` (stock transformers' static cache + torch.compile, ``generate()`` in
fixed batches of 32 chat requests in arrival order, each batch when its last request has arrived; the
long-context requests are not run: the message says what a static cache for them would need).

Metrics per system: mean and peak concurrent requests (requests holding memory, sampled every 0.25 s), the
share of samples with a request waiting and the mean concurrency over them (:func:`queued_concurrency`),
preemptions, TTFT and TPOT p50 / p99 (seconds), output tokens/s and requests/s over the run, refusals (steps
whose queue head found no room) and refusals with room (the arena's free bytes could have held it), row waits
(steps whose queue head waited for a decode row: rows, not memory, bound admission; 2026-12-02's sixteenth-session
runs needed it to tell the two apart), pages
and slots in use at the end (leaks), and timelines (arena occupancy per side, tokens/s) for the plots;
``time_split`` (:func:`time_split`): the run's wall in decode blocks, prefill forwards, the rest of the engine's
steps and idle time, with the prefill forward count and the pool's compactions (2026-12-02's runs lacked it:
decode was under a tenth of the wall and the rest was not attributed); ``prefill_forwards``
(:func:`prefill_forwards`): every prefill forward's wall, by kind (first or later chunk, final or not, size),
with the slowest and the correlation with the rows decoding beside it (2026-12-02 (fifteenth session): prefill
took 54-64 s of each phased run's 59-69 s, ~240 ms per forward of ~1.6k tokens).
``--prefill-probe`` (:func:`prefill_probe`): after the warm-up, one request's prefill at a time through
``generate()``, the engine stepped on the caller's thread and a started manager, with a profile: whether the
engine's prefill is slow alone or only inside a run.
``--step-check``: the engine's decode step at 32 running rows against the runner's ``generate()`` step at
batch 32 (ms per step; the target is within 1.2x); it runs before the traces.

Fairness: the systems run one after another in one process, in ``--systems`` order, after one warm-up
(:func:`warm_up`) that compiles everything a timed run can reach: every decode bucket's step, and prefill
chunks of every length class of the kernels' own selection (the write kernel's tokens per program, the
prefill attention's query tile and workspace pieces, flash-linear-attention's l2norm autotune bucket, which
turns at 2048 tokens x 32 heads, the graph forms) as first chunks, later chunks and chunks whose history
crosses the workspace, plus budget splits. Before it, the first system paid Triton's compiles and fla's
autotuning inside its timed window (2026-12-02: static0.5 ran first, compiled 35 kernels in its run and
queued, TTFT p50 8.6 s against unified's 0.06 s; 2026-12-01: unified ran first and was 20% slower). A run
that still compiled (Dynamo graphs, Triton kernels or chunk_kda graph captures) carries ``confounded_by_jit:
true``, is printed with a warning, and so are the ratios that use it. Mean concurrency is a fair comparison only
at the issue's rate: below the capacity of both systems the faster one holds each request for less time and so
has FEWER requests in flight (Little's law, L = lambda x W); hence ``--find-rate``.

GPU, full run (one H200; ~2 x 3000 requests per system: budget about 15-25 minutes per system and trace at
a rate near capacity; run systems in separate device calls, each writes its JSON):
    python benchmarks/bench_serving.py --systems unified --traces stationary,phased --rate R \
        --out $OUT/serving_unified.json
GPU, issue 23 in four calls (``gpu_session.sh`` steps ``bench_serving_rate``, then ``bench_serving_stationary``
and ``bench_serving_phased`` with ``SERVE_RATE`` = the first call's rate, then ``bench_serving_stock``; each under
570 s of one H200, each with ``--deadline-s 480``, each paying the build (~14 s) and the warm-up (227 s on a new
machine, 95 s once its caches are warm, 2026-12-02)):
    --scale 0.05 --budget-gib 0.75 --max-batch 32 --drain-timeout-s 30, systems static0.5, unified,
    static0.25, static0.75, simbest; the first call runs --find-rate --rate-lo 3 --rate-hi 6 --rate-iters 4
    alone on the stationary trace (runs cut at the last arrival: 150 / rate, 25-50 s each; on 2026-12-02 every
    rate from 4/s up was unbounded, every system served ~2.9 requests/s at 4/s), the next two --rate R, the
    phased one with --step-check; the last stock_cb, stock_static on the phased trace.
  How it departs from the issue, and why: 5% of each trace's requests (150 stationary, 75 + 3 + 75 phased),
  not 3000 / 3060, because five systems of 3000 requests take hours, not a 10-minute call; the arena scaled
  with the trace (0.75 GiB, not 6 GiB) so that memory binds, as below; 32 decode rows; the rate bisected on
  that short stationary trace (a noisier form of the issue's rule, ~0.4 requests/s apart); a system that has
  not served its trace 30 s after the last arrival is stopped and its run records what it served; the two
  traces in two processes (same commit, same seed, each with its own warm-up); the stock systems in a call
  of their own.
GPU, reduced (one call, the sessions before the preset above): --scale 0.05 --budget-gib 0.75 --max-batch 32
    --systems static0.5,unified --traces phased --rate 8. The arena shrinks with the trace: at scale 0.05 the
    phased burst has 3 long-context requests, and 6 GiB holds ~2.8M tokens or 488 state slots of this model
    (``unimem-compile pool-info``), so memory never binds (2026-12-01: 14% peak occupancy, both systems capped
    by 32 rows alike). 0.75 GiB holds 343k tokens or 60 slots (13.2 MB each): 32 chat rows' slots (~420 MB)
    beside the burst's 16k-96k-token prompts (37-221 MB each) contend as the full run's 6 GiB does with its
    60; a 50/50 split holds 30 slots.
CPU smoke (tiny model, every system and trace, ~2 minutes on two cores, most of it the warm-up's compiles; the
JSON and plot go to the temp folder, never over a result of record):
    python benchmarks/bench_serving.py --device cpu --smoke
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import sys
import tempfile
import threading
import time
import warnings
from typing import NamedTuple

import numpy as np
import torch

GIB = 1 << 30
SYSTEMS = ("unified", "static0.25", "static0.5", "static0.75", "simbest", "stock_cb", "stock_static")
TRACE_NAMES = ("stationary", "phased")


# ---------------------------------------------------------------------------------------------- traces
def chat_lengths(rng: np.random.Generator, n: int, scale_tokens: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Chat: prompt lognormal (median 1024, sigma 1.0, clipped 64..8192), output lognormal (median 128,
    sigma 0.7, clipped 16..512); ``scale_tokens`` shrinks every length (the CPU smoke run)."""
    prompt = np.clip(rng.lognormal(math.log(1024), 1.0, n), 64, 8192)
    output = np.clip(rng.lognormal(math.log(128), 0.7, n), 16, 512)
    return (np.maximum(1, prompt * scale_tokens).astype(np.int64),
            np.maximum(1, output * scale_tokens).astype(np.int64))


def long_lengths(rng: np.random.Generator, n: int, scale_tokens: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Long context: prompt log-uniform 16k..96k tokens, output 128."""
    prompt = np.exp(rng.uniform(math.log(16 * 1024), math.log(96 * 1024), n))
    return (np.maximum(1, prompt * scale_tokens).astype(np.int64),
            np.full(n, max(1, int(128 * scale_tokens)), dtype=np.int64))


def make_trace(name: str, rate: float, seed: int, scale: float = 1.0, scale_tokens: float = 1.0) -> list[dict]:
    """The trace's requests ``{"i", "arrival" (s), "prompt", "output", "kind"}`` sorted by arrival (module
    docstring); ``scale``: the fraction of each phase's requests kept (at least one)."""
    rng = np.random.default_rng(seed)

    def count(n):
        return max(1, int(round(n * scale)))

    if name == "stationary":
        n = count(3000)
        arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
        kinds = np.where(rng.random(n) < 0.02, "long", "chat")
    elif name == "phased":
        n_chat, n_long = count(1500), count(60)
        first = np.cumsum(rng.exponential(1.0 / rate, n_chat))
        duration = 2 * first[-1] / 0.95  # the two chat phases are 95% of the trace
        long_start = first[-1]
        longs = long_start + np.sort(rng.uniform(0, 0.05 * duration, n_long))
        third = longs[-1] + np.cumsum(rng.exponential(1.0 / rate, n_chat))
        arrivals = np.concatenate([first, longs, third])
        kinds = np.array(["chat"] * n_chat + ["long"] * n_long + ["chat"] * n_chat)
    else:
        raise ValueError(f"unknown trace {name!r}; traces: {TRACE_NAMES}")
    prompt = np.zeros(len(kinds), dtype=np.int64)
    output = np.zeros(len(kinds), dtype=np.int64)
    for kind, draw in (("chat", chat_lengths), ("long", long_lengths)):
        sel = kinds == kind
        prompt[sel], output[sel] = draw(rng, int(sel.sum()), scale_tokens)
    order = np.argsort(arrivals, kind="stable")
    return [{"i": int(k), "arrival": float(arrivals[j]), "prompt": int(prompt[j]), "output": int(output[j]),
             "kind": str(kinds[j])} for k, j in enumerate(order)]


# ---------------------------------------------------------------------------------------------- the model
def build(args):
    import unimem_compile
    from unimem_compile.hf.models import build_model

    device = torch.device(args.device)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    torch.manual_seed(args.seed)
    model = build_model(args.model, device=device, dtype=dtype, seed=args.seed)
    # the stock systems run an uncompiled copy with the same weights (build_model seeds its initialisation)
    stock = build_model(args.model, device=device, dtype=dtype, seed=args.seed) if args.keep_stock else None
    unimem_compile.compile(model, max_batch_size=args.max_batch, max_seq_len=args.max_seq_len,
                           memory_budget=int(args.budget_gib * GIB), page_size=args.page_size,
                           backend="aot_eager" if args.smoke else "inductor")
    return model, stock


def memory_for(model, system: str, share: float | None = None):
    from unimem_compile.engine import PoolMemory, QuotaMemory

    pool = model.unimem.pool
    if system == "unified":
        return PoolMemory(pool)
    if system.startswith("static"):
        return QuotaMemory(pool, float(system[len("static"):]))
    if system == "simbest":
        return QuotaMemory(pool, share)
    raise ValueError(system)


def sim_best_share(model, trace: list[dict], args) -> float:
    """The static KV share the capacity simulator finds best for ``trace`` (grid 0.05 .. 0.95 step 0.05, most
    mean concurrent requests) on the model's geometry and budget; arrivals in ticks of ``--sim-tick-s``."""
    from unimem_compile.sim import Request, StaticSplitSystem, simulate

    adapter = model.unimem.adapter
    kv, state = adapter.kv_spec, adapter.state_spec
    reqs = [Request(r["i"], int(r["arrival"] / args.sim_tick_s), r["prompt"], r["output"], r["kind"]) for r in trace]
    best, best_mean = None, -1.0
    for share in [round(0.05 * i, 2) for i in range(1, 20)]:
        try:
            system = StaticSplitSystem(kv, state, model.unimem.pool.layout.memory_budget, share, args.page_size)
        except Exception:  # noqa: BLE001 - a share too small for one page or slot
            continue
        result = simulate(system, reqs, kv, state, tokens_per_tick=model.unimem.steps_ahead)
        if result.mean_concurrent > best_mean:
            best, best_mean = share, result.mean_concurrent
    return best


# ---------------------------------------------------------------------------------------------- one run
def percentile(values, q):
    return float(np.percentile(values, q)) if len(values) else None


def log_prefill_forwards(engine) -> list[tuple]:
    """Wrap ``engine``'s prefill forwards (this instance only: ``_prefill_chunk``, and ``_prefill_packed`` where
    it has one) to record each call as ``(tokens, start, ms, final, decoding, rows)``: the forward's new tokens
    (a pack's ``rows x width``, pads included), the tokens its request stored before it (0 for a pack), the
    call's wall (ms; the host's enqueue time, plus the GPU wait when ``final``: the chunk that ends a prompt
    reads its logits; a pack always does), whether it was final, the rows decoding beside it, and the requests
    in the forward. No synchronisation is added: the engine runs as it does unwrapped. Returns the list the
    calls append to."""
    log: list[tuple] = []
    forward = engine._prefill_chunk

    def logged(req, chunk):
        start, t = req.prefilled, time.perf_counter()
        logits = forward(req, chunk)
        log.append((int(chunk), int(start), (time.perf_counter() - t) * 1e3, logits is not None, len(engine.rows), 1))
        return logits

    engine._prefill_chunk = logged
    packed = getattr(engine, "_prefill_packed", None)
    if packed is not None:
        def logged_pack(group, width):
            decoding, t = len(engine.rows), time.perf_counter()
            packed(group, width)
            log.append((int(width) * len(group), 0, (time.perf_counter() - t) * 1e3, True, decoding, len(group)))

        engine._prefill_packed = logged_pack
    return log


def prefill_forwards(log: list[tuple]) -> dict | None:
    """Summary of :func:`log_prefill_forwards`' records (ms per forward, p50 / p90 / max, overall and by
    kind: first chunks (``start`` 0) and later ones, final and not, chunks of < 1024 and >= 1024 tokens, packs
    of several requests; ms per 1k tokens p50), the five slowest forwards, and the Pearson correlation of a
    forward's ms with the rows decoding beside it (None: fewer than 3 forwards or no spread)."""
    if not log:
        return None
    arr = np.asarray(log, dtype=np.float64)
    tokens, start, ms, final, rows, requests = arr.T

    def stats(mask):
        sel = ms[mask]
        return {"forwards": int(mask.sum()), "p50_ms": percentile(sel, 50), "p90_ms": percentile(sel, 90),
                "max_ms": float(sel.max()) if len(sel) else None}

    every = np.ones(len(ms), dtype=bool)
    corr = None
    if len(ms) >= 3 and ms.std() > 0 and rows.std() > 0:
        corr = float(np.corrcoef(ms, rows)[0, 1])
    slowest = sorted(log, key=lambda e: -e[2])[:5]
    return {"all": stats(every), "first_chunk": stats(start == 0), "later_chunk": stats(start > 0),
            "final": stats(final > 0), "not_final": stats(final == 0), "under_1k_tokens": stats(tokens < 1024),
            "from_1k_tokens": stats(tokens >= 1024), "packed": stats(requests > 1),
            "ms_per_1k_tokens_p50": percentile(1e3 * ms / tokens, 50), "corr_ms_rows_decoding": corr,
            "slowest": [{"tokens": int(t), "start": int(s0), "ms": m, "final": bool(f), "decoding": int(r),
                         "requests": int(n)} for t, s0, m, f, r, n in slowest]}


def time_split(counters: dict, memory_stats: dict, seconds: float) -> dict:
    """Where a run's wall time went, from the engine's counters (seconds; ``seconds`` is the run's wall):
    ``decode_s`` (decode blocks with their readback, which also waits for the GPU work queued before them),
    ``prefill_s`` (prefill forwards: host time, plus the GPU wait of the chunks that end a prompt),
    ``other_step_s`` (the rest of the engine's steps: cancellations, growth, admission, bookkeeping),
    ``idle_s`` (the engine thread outside steps: waiting for requests, handing results over); with the step
    and prefill-forward counts, prefill tokens and the pool's compactions and bytes moved in the run
    (``memory_stats``)."""
    step_s, decode_s, prefill_s = counters["step_s"], counters["decode_s"], counters["prefill_s"]
    return {"steps": counters["steps"], "step_s": step_s, "decode_s": decode_s, "prefill_s": prefill_s,
            "other_step_s": max(0.0, step_s - decode_s - prefill_s), "idle_s": max(0.0, seconds - step_s),
            "prefill_chunks": counters["prefill_chunks"], "prefill_tokens": counters["prefill_tokens"],
            # packing (Engine max_prefill_rows): forwards of several whole prompts, the prompts in them, their pads
            "packed_forwards": counters.get("packed_forwards", 0), "packed_rows": counters.get("packed_rows", 0),
            "prefill_pads": counters.get("prefill_pads", 0),
            "prefill_tokens_per_s": counters["prefill_tokens"] / prefill_s if prefill_s else None,
            "compactions": memory_stats.get("compactions"), "bytes_moved": memory_stats.get("bytes_moved")}


def run_engine(model, system: str, trace: list[dict], args, share: float | None = None, drain: bool = True) -> dict:
    """Serve ``trace`` on the engine with ``system``'s memory; returns the metrics (module docstring).
    ``drain=False`` stops at the last arrival (what is still running is stopped, not served): the rate
    search needs only the queue while requests arrive."""
    from unimem_compile.ops.kda_graphs import GRAPHS as KDA_GRAPHS

    vocab = model.config.vocab_size
    rng = np.random.default_rng(args.seed + 1)
    manager = model.init_continuous_batching(memory=memory_for(model, system, share),
                                             max_prefill_tokens=args.max_prefill_tokens,
                                             max_prefill_rows=args.max_prefill_rows)
    lay = model.unimem.pool.layout
    timeline = {"t": [], "running": [], "waiting": [], "kv_bytes": [], "state_bytes": [], "generated": []}
    stop = threading.Event()

    def monitor(start):
        while not stop.is_set():
            m = manager.metrics()
            timeline["t"].append(time.perf_counter() - start)
            for k in ("running", "waiting", "kv_bytes", "state_bytes"):
                timeline[k].append(m[k])
            timeline["generated"].append(m["generated_tokens"])
            stop.wait(args.sample_s)

    prompts = [rng.integers(0, vocab, r["prompt"]).tolist() for r in trace]
    refused = []
    graphs_before = _compiled_graphs()
    captures_before = KDA_GRAPHS.captures
    moved_before = manager.engine.memory.stats()  # the pool's counts since it was built: this run's are the growth
    forwards = log_prefill_forwards(manager.engine)
    with torch.no_grad(), TritonCompiles() as jit:
        manager.start()
        start = time.perf_counter()
        watcher = threading.Thread(target=monitor, args=(start,), daemon=True)
        watcher.start()
        ids = {}
        for r, p in zip(trace, prompts):
            delay = start + r["arrival"] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            try:
                ids[manager.add_request(p, max_new_tokens=r["output"], min_new_tokens=r["output"])] = r
            except Exception as e:  # noqa: BLE001 - a request the arena can never hold: recorded
                refused.append({"i": r["i"], "error": f"{type(e).__name__}: {e}"})
        results = {}
        deadline = time.perf_counter() + (args.drain_timeout_s if drain else 0.0)
        while len(results) < len(ids) and time.perf_counter() < deadline:
            out = manager.get_result(timeout=1.0)
            if out is not None and out.is_finished():
                results[out.request_id] = out
        end = time.perf_counter()
        manager.stop(block=True, hard_stop=len(results) < len(ids))
        stop.set()
        watcher.join()
    counters = manager.engine.counters
    ttft, tpot, tokens = [], [], 0
    for rid, out in results.items():
        r = ids[rid]
        tokens += len(out.generated_tokens)
        first, last = out.lifespan
        if first > 0:
            ttft.append(first - (start + r["arrival"]))
            if len(out.generated_tokens) > 1:
                tpot.append((last - first) / (len(out.generated_tokens) - 1))
    running = np.asarray(timeline["running"], dtype=np.float64)
    gen = np.asarray(timeline["generated"], dtype=np.float64)
    t = np.asarray(timeline["t"])
    rate = (np.diff(gen) / np.maximum(np.diff(t), 1e-9)).tolist() if len(t) > 1 else []
    stats = model.unimem.stats()
    seconds = end - start
    graphs = _compiled_graphs() - graphs_before
    compiles = len(jit.names) if jit.available else None
    captures = KDA_GRAPHS.captures - captures_before
    return {
        "system": manager.engine.memory.name, "requests": len(trace), "served": len(results),
        "failed": sum(1 for o in results.values() if o.error is not None), "never_fits": refused,
        "mean_concurrent": float(running.mean()) if len(running) else 0.0,
        "peak_concurrent": int(running.max()) if len(running) else 0,
        **queued_concurrency(running, timeline["waiting"]),
        "preemptions": counters["preemptions"], "refusals": counters["refusals"],
        "refused_with_room": counters["refused_with_room"], "row_waits": counters["row_waits"],
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "output_tokens_per_s": tokens / seconds, "requests_per_s": len(results) / seconds, "seconds": seconds,
        "decode_ms_per_step": 1e3 * counters["decode_s"] / max(1, counters["decode_steps"]),
        "mean_rows_per_step": counters["decode_row_steps"] / max(1, counters["decode_steps"]),
        "time_split": time_split(counters, {k: v - moved_before[k] for k, v in manager.engine.memory.stats().items()},
                                 seconds),
        "prefill_forwards": prefill_forwards(forwards),
        "leaked_pages": stats["kv_pages_used"], "leaked_slots": stats["state_slots_used"],
        "kv_share": share if share is not None else getattr(manager.engine.memory, "kv_fraction", None),
        "arena_bytes": lay.memory_budget,
        # graphs Dynamo compiled inside the timed window (warm_up should leave none): a run that compiles pays
        # for it in its TTFT and tokens/s, and the systems run one after another, so the first would pay alone
        "graphs_compiled_in_run": graphs,
        # Triton kernels specialised inside the timed window (a new int-argument specialisation of a custom op's
        # kernel compiles, or loads from the disk cache, on the engine thread): None where Triton has no hook
        "triton_compiles_in_run": compiles,
        "triton_kernels_compiled_in_run": dict(collections.Counter(jit.names)) if jit.available else None,
        # either count above 0: the run paid for compiles in its own TTFT and tokens/s (a queue built while a
        # kernel compiles drains late), so it is no fair side of a comparison; None: Triton's count is unknown
        # chunk_kda graphs captured inside the timed window (ops/kda_graphs; the warm-up covers every bucket): a
        # capture synchronises the device and empties the allocator's cache on the engine thread
        "kda_graphs_captured_in_run": captures,
        "confounded_by_jit": confounded_by_jit(graphs, compiles, captures),
        "timeline": {**timeline, "tokens_per_s": rate},
    }


def confounded_by_jit(graphs_compiled: int, triton_compiles: int | None, kda_captures: int = 0) -> bool | None:
    """Whether a timed run compiled anything: True when any count is above 0 (Dynamo graphs, Triton kernels,
    chunk_kda graph captures), None when nothing else did and the Triton count is unknown (None: no hook), else
    False."""
    if graphs_compiled > 0 or (triton_compiles or 0) > 0 or kda_captures > 0:
        return True
    return None if triton_compiles is None else False


def comparison(results: dict) -> dict | None:
    """The issue's ratios on one trace: unified over each other engine system's mean concurrent requests and
    over its TTFT p99, with the targets (>= 1.3x the 50/50 split's concurrency and >= 1.0x every split's;
    TTFT p99 <= 0.7x the 50/50 split's), and a ``warning`` naming the systems whose runs compiled (their
    numbers include compile time: the comparison is confounded). None without a unified run."""
    u = results.get("unified")
    if not u or not u.get("mean_concurrent"):
        return None
    out = {}
    for name, r in results.items():
        if name == "unified" or not isinstance(r, dict) or not r.get("mean_concurrent") or "confounded_by_jit" not in r:
            continue
        out[f"unified_over_{name}_mean_concurrent"] = u["mean_concurrent"] / r["mean_concurrent"]
        out[f"unified_over_{name}_ttft_p99"] = (u["ttft_p99_s"] / r["ttft_p99_s"]
                                                if u["ttft_p99_s"] and r["ttft_p99_s"] else None)
    if "unified_over_static0.5_mean_concurrent" in out:  # the names of record before every split was compared
        out["unified_over_50_50_mean_concurrent"] = out["unified_over_static0.5_mean_concurrent"]
        out["ttft_p99_over_50_50"] = out["unified_over_static0.5_ttft_p99"]
    out["targets"] = {"unified_over_50_50_mean_concurrent": ">= 1.3", "unified_over_<every split>_mean_concurrent":
                      ">= 1.0", "ttft_p99_over_50_50": "<= 0.7"}
    confounded = sorted(name for name, r in results.items() if isinstance(r, dict) and r.get("confounded_by_jit"))
    if confounded:
        out["warning"] = (f"confounded by JIT: {', '.join(confounded)} compiled inside the timed run "
                          "(graphs_compiled_in_run / triton_compiles_in_run > 0): these ratios include compile time")
    return out


class TritonCompiles:
    """Context manager counting Triton JIT compiles while it is active: every kernel specialisation a
    ``@triton.jit`` / Gluon function builds in this process (compiled, or loaded from Triton's disk cache), through
    ``triton.knobs.runtime.jit_post_compile_hook`` (a hook already there is kept and called). ``names`` lists
    the kernels' names, one per compile; ``available`` is False where this Triton has no such hook. Inductor's
    own kernels are built when Dynamo compiles a graph and are not counted here."""

    def __init__(self):
        self.names: list[str] = []
        self.available = False
        self._runtime = self._previous = None

    def __enter__(self):
        try:
            from triton import knobs
            runtime = knobs.runtime
            previous = runtime.jit_post_compile_hook
        except (ImportError, AttributeError):
            return self
        self._runtime, self._previous, self.available = runtime, previous, True

        def hook(*args, **kwargs):
            self.names.append(str(kwargs.get("repr", "?")).split("[", 1)[0])
            return previous(*args, **kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = hook
        return self

    def __exit__(self, *exc) -> None:
        if self.available:
            self._runtime.jit_post_compile_hook = self._previous


def _compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (``torch._dynamo.utils.counters``)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def run_stock_cb(stock, trace, args) -> dict:
    """Stock transformers' generate_batch on the same (uncompiled) model: its error, or what it did."""
    if stock is None:
        return {"system": "stock generate_batch", "error": "not run (pass --keep-stock)"}
    rng = np.random.default_rng(args.seed + 1)
    prompts = [rng.integers(0, stock.config.vocab_size, min(r["prompt"], 64)).tolist() for r in trace[:2]]
    try:
        with torch.no_grad():
            out = stock.generate_batch(prompts, max_new_tokens=4)
        return {"system": "stock generate_batch", "error": None, "results": len(out)}
    except Exception as e:  # noqa: BLE001 - the point: it refuses hybrid models
        return {"system": "stock generate_batch", "error": f"{type(e).__name__}: {e}"[:500]}


def run_stock_static(stock, trace, args, deadline: float | None = None) -> dict:
    """Stock static cache + compile, fixed batches of 32 chat requests in arrival order (left padded);
    no batch starts after ``deadline`` (a ``perf_counter`` time; None: no limit): ``batches_run`` says how
    many ran (each new batch width recompiles the static cache's graphs)."""
    if stock is None:
        return {"system": "stock static cache + compile", "error": "not run (pass --keep-stock)"}
    chats = [r for r in trace if r["kind"] == "chat"]
    longs = [r for r in trace if r["kind"] == "long"]
    rng = np.random.default_rng(args.seed + 1)
    vocab = stock.config.vocab_size
    device = next(stock.parameters()).device
    ttft, tpot, tokens, error, batches = [], [], 0, None, 0
    start = time.perf_counter()
    try:
        for b in range(0, len(chats), 32):
            if deadline is not None and time.perf_counter() > deadline:
                break
            batches += 1
            batch = chats[b:b + 32]
            wait = start + batch[-1]["arrival"] - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            width = max(r["prompt"] for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for k, r in enumerate(batch):
                ids[k, width - r["prompt"]:] = torch.from_numpy(rng.integers(0, vocab, r["prompt"]))
                mask[k, width - r["prompt"]:] = 1
            new = max(r["output"] for r in batch)
            times = []

            class Clock:
                def put(self, value):
                    times.append(time.perf_counter())

                def end(self):
                    pass

            with torch.no_grad():
                stock.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, cache_implementation="static",
                               streamer=Clock())
            first = times[1] if len(times) > 1 else times[-1]
            for r in batch:
                ttft.append(first - (start + r["arrival"]))
                done = times[min(len(times) - 1, r["output"])]
                if r["output"] > 1:
                    tpot.append((done - first) / (r["output"] - 1))
                tokens += r["output"]
    except Exception as e:  # noqa: BLE001 - recorded
        error = f"{type(e).__name__}: {e}"[:500]
    seconds = time.perf_counter() - start
    longest = max((r["prompt"] + r["output"] for r in longs), default=0)
    return {"system": "stock static cache + compile", "error": error, "batches_of": 32, "batches_run": batches,
            "batches": -(-len(chats) // 32),
            "chat_requests": len(chats), "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
            "output_tokens_per_s": tokens / seconds if seconds else None,
            "long_context": (f"{len(longs)} long-context requests not run: a static cache sized for the longest "
                             f"({longest} tokens) in a batch of 32 holds 32 x {longest} tokens of KV and 32 states "
                             f"for every batch") if longs else None}


def step_check(model, args) -> dict:
    """The engine's decode step at 32 rows vs the runner's generate() step at batch 32, same prompt."""
    rows = min(32, args.max_batch)
    prompt, new = (1024, 64) if not args.smoke else (24, 8)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (rows, prompt), generator=g)
    device = model.unimem.pool.device
    # random ids include the pad id: without a mask generate() would infer padding from it and refuse the rows
    # (only left padding is supported); every position is a real token here, as in the engine's requests
    kw = dict(attention_mask=torch.ones_like(ids).to(device), max_new_tokens=new, min_new_tokens=new,
              do_sample=False)
    with torch.no_grad():
        model.generate(ids.to(device), **kw)
        with model.unimem.timed_decode() as timing:
            model.generate(ids.to(device), **kw)
        runner_ms = 1e3 * timing.decode_seconds() / max(1, timing.decode_steps)
        for _ in range(2):  # the second round is warm
            manager = model.init_continuous_batching(max_prefill_tokens=rows * prompt)
            for row in ids.tolist():
                manager.add_request(row, max_new_tokens=new, min_new_tokens=new)
            while manager.step():
                pass
    c = manager.engine.counters
    engine_ms = 1e3 * c["decode_s"] / max(1, c["decode_steps"])
    return {"rows": rows, "prompt": prompt, "runner_ms_per_step": runner_ms, "engine_ms_per_step": engine_ms,
            "ratio": engine_ms / runner_ms, "target": 1.2,
            "mean_rows_per_step": c["decode_row_steps"] / max(1, c["decode_steps"])}


#: prompt lengths of ``--prefill-probe`` (tokens; the smoke preset divides them by 32)
PROBE_LENGTHS = (256, 1024, 2048, 4096, 16384)
#: of those, the lengths whose engine prefill runs once more under the profiler
PROBE_PROFILED = (1024, 4096)


def prefill_probe(model, args, repeats: int = 3) -> dict:
    """One request's prefill at a time, three ways on the same compiled model, to attribute the engine's
    prefill time (2026-12-02: ~240 ms per prefill forward of ~1.6k tokens inside the trace runs, against
    ~24 ms for a 4k-token prefill of half the layers in bench_mla_prefill):

    * ``generate``: ``model.generate(prompt, max_new_tokens=1, prefill_chunk_size=--max-prefill-tokens)``;
    * ``engine_sync``: the engine stepped on this thread (``manager.step()`` until idle), one request of
      ``max_new_tokens=1``;
    * ``engine_thread``: the same request through a started manager (its background loop), the caller
      blocked in ``get_result``, as the trace runs do;
    * ``engine_sync_nographs``: ``engine_sync`` with ``UNIMEM_KDA_GRAPHS=0`` (fla's ``chunk_kda`` eager, not
      replayed from ops/kda_graphs' graphs).

    Each length (:data:`PROBE_LENGTHS`) runs once untimed per way (compiles, autotuning), then ``repeats``
    times; the record keeps the median wall (ms) and, for the engine, the engine's own ``prefill_s`` per
    forward. The engine's way at :data:`PROBE_PROFILED` runs once more under ``torch.profiler``
    (``bench_mla_prefill.kernel_breakdown``: kernel time, busy fraction, the host's launches, blocking calls
    and untraced Python). Returns ``{"lengths": [{"tokens", "generate_ms", "engine_sync_ms",
    "engine_thread_ms", "engine_sync_nographs_ms", "engine_forwards", "engine_prefill_ms_per_forward", "profile"?}],
    "chunk": int}``."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:  # python -P leaves the script's folder off the path
        sys.path.insert(0, here)
    from bench_mla_prefill import _sync, kernel_breakdown

    from unimem_compile import env

    device = model.unimem.pool.device
    scale = 1 / 32 if args.smoke else 1
    lengths = [max(2, int(n * scale)) for n in PROBE_LENGTHS]
    lengths = [n for n in lengths if n + 2 <= args.max_seq_len]
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed + 7)

    def timed(fn) -> float:
        fn()
        walls = []
        for _ in range(repeats):
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            walls.append((time.perf_counter() - t) * 1e3)
        return float(np.median(walls))

    rows = []
    with torch.no_grad():
        for n in lengths:
            prompt = torch.randint(3, vocab, (n,), generator=g).tolist()
            ids = torch.tensor([prompt], device=device)
            mask = torch.ones_like(ids)  # random ids may hit the pad id: every position is a token

            def by_generate():
                model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                               prefill_chunk_size=args.max_prefill_tokens)

            sync_manager = model.init_continuous_batching(max_prefill_tokens=args.max_prefill_tokens)

            def by_engine():
                sync_manager.add_request(prompt, max_new_tokens=1)
                while sync_manager.step():
                    pass
                out = sync_manager.get_result()
                if out is None or out.error is not None:
                    raise RuntimeError(f"prefill probe: the engine's request of {n} tokens failed: "
                                       f"{None if out is None else out.error}")

            row = {"tokens": n, "generate_ms": timed(by_generate)}
            c = sync_manager.engine.counters
            before = c["prefill_chunks"], c["prefill_s"]
            row["engine_sync_ms"] = timed(by_engine)
            forwards, seconds = c["prefill_chunks"] - before[0], c["prefill_s"] - before[1]
            row["engine_forwards"] = forwards / (repeats + 1)
            row["engine_prefill_ms_per_forward"] = 1e3 * seconds / max(1, forwards)
            with env.overridden(env.KDA_GRAPHS, "0"):  # the same, fla's chunk_kda eager (ops/kda_graphs off)
                row["engine_sync_nographs_ms"] = timed(by_engine)
            if n in PROBE_PROFILED or (args.smoke and n == lengths[0]):
                row["profile"] = kernel_breakdown(by_engine, device)
            manager = model.init_continuous_batching(max_prefill_tokens=args.max_prefill_tokens)
            manager.start()
            try:
                def by_thread():
                    rid = manager.add_request(prompt, max_new_tokens=1)
                    out = manager.get_result(rid, timeout=600)
                    if out is None or out.error is not None:
                        raise RuntimeError(f"prefill probe: the started manager's request of {n} tokens failed")

                row["engine_thread_ms"] = timed(by_thread)
            finally:
                manager.stop(block=True)
            rows.append(row)
            extra = ""
            prof = row.get("profile")
            if prof:
                extra = (f"; profiled engine: {prof['kernel_ms']:.1f} ms of kernels in {prof['wall_ms']:.1f} ms "
                         f"(busy {prof['busy_fraction']:.0%})")
                host = prof.get("host")  # CUDA only
                if host:
                    extra += (f", host {json.dumps({k: v for k, v in host.items() if k != 'top'})}, top "
                              + ", ".join(f"{t['name'][:40]} {t['ms']:.1f} ms x{t['calls']}" for t in host["top"][:8]))
            print(f"prefill probe {n:6d} tokens: generate {row['generate_ms']:.1f} ms, engine (this thread) "
                  f"{row['engine_sync_ms']:.1f} ms ({row['engine_forwards']:g} forwards, "
                  f"{row['engine_prefill_ms_per_forward']:.1f} ms each; {row['engine_sync_nographs_ms']:.1f} ms with "
                  f"UNIMEM_KDA_GRAPHS=0), engine (started manager) "
                  f"{row['engine_thread_ms']:.1f} ms{extra}", flush=True)
    return {"chunk": args.max_prefill_tokens, "repeats": repeats, "lengths": rows}


# ---------------------------------------------------------------------------------------------- warm-up
#: flash-linear-attention's ``l2norm_fwd`` (the q / k norm of its chunked KDA) autotunes ~25 configs per key
#: ``(D, NB)``, ``NB = cdiv(rows, 2048 * 32)`` with ``rows = tokens x heads``: a chunk's token count moves NB
FLA_L2NORM_ROWS_PER_BUCKET = 2048 * 32
#: tokens each warm-up request generates (two: a decode block after the prefill's token); the traces' outputs
#: are longer (16 and more; 4 and more in the smoke run), so their prompts fit the same max_seq_len
WARM_UP_NEW_TOKENS = 2


class Chunk(NamedTuple):
    """One prefill forward of the engine: ``rows`` requests (1, or a pack of whole prompts) of ``T`` tokens
    each (the pack's longest prompt; shorter ones left-padded: ``padded``), after ``start`` stored tokens."""

    T: int
    start: int
    rows: int = 1
    padded: bool = False


def prefill_variants(T: int, start: int, *, kda_heads: int, workspace_tokens: int, arch: int | None = 90,
                     rows: int = 1, padded: bool = False) -> set:
    """What one engine prefill forward of ``rows`` x ``T`` tokens, stored after the first ``start`` tokens of
    its request(s), makes the process compile, as ``(what, variant)`` pairs (a forward whose pairs were all seen
    before compiles nothing new).

    * ``graph``: the Dynamo graph. ``T = 1`` runs the decode form (``mla_absorb``, transformers' recurrent
      KDA and conv update), ``T >= 2`` the prefill graph with a symbolic T (``hf/step_inputs.py``); a first
      chunk (``start = 0``) is transformers' first-prefill form (no mask), a later one the masked form. A pack
      (``rows >= 2``, ``Engine._prefill_packed``) is a first step with a 2-D mask, a stand-in 4-D one where
      ``padded`` (else transformers' mask-free form), and a batch dimension Dynamo specialises at its first
      size and makes dynamic at its second: the class ``2`` (the warm-up's first pack size) or ``3+``.
    * ``mla_kv_write``: the write kernel's tokens per program (``ops/mla_write._block_t`` of the forward's
      ``rows x T`` tokens; T itself is not specialised).
    * ``mla_prefill`` (``T >= 2``): the attention kernel's query tile (``ops/mla_prefill._tiles`` for
      ``arch``, 10 x major + minor, None: the interpreter) and whether the history ``start + T`` spans
      more than one workspace piece (a running fp32 output: another pointer type, another kernel).
    * ``fla_l2norm`` (``T >= 2``, where fla is installed): its autotune bucket NB for ``rows x T x kda_heads``.
    * ``kda_graph`` (``T >= 2``, where fla is installed): the bucket of ``ops/kda_graphs`` whose ``chunk_kda``
      graph the forward replays (one per rows x bucket), captured at its first use (None: past the largest
      bucket, fla eager).

    Everything else a chunk launches is specialised on sizes a serving run never changes (head counts,
    strides, the layer), or on nothing (fla's chunk kernels take T unspecialised and autotune on head dims).
    """
    from unimem_compile.ops import kda_graphs, mla_prefill as prefill_op, mla_write

    first = "first" if start == 0 else "later"
    form = f"{'one-token' if T == 1 else 'chunk'} {first}"
    if rows >= 2:
        form = f"{'one-token' if T == 1 else 'chunk'} packed {'2' if rows == 2 else '3+'}" + (" padded" * padded)
    out = {("graph", form), ("mla_kv_write", (rows, mla_write._block_t(rows * T)))}
    if T >= 2:
        out.add(("mla_prefill", (prefill_op._tiles(arch, T)["block_m"], start + T > workspace_tokens)))
        out.add(("fla_l2norm", -(-rows * T * kda_heads // FLA_L2NORM_ROWS_PER_BUCKET)))
        out.add(("kda_graph", (rows, kda_graphs.bucket_for(rows, T))))  # its chunk_kda graph (None: eager fla)
    return out


def chunk_variants(chunk: Chunk, **kw) -> set:
    """:func:`prefill_variants` of one :class:`Chunk`."""
    return prefill_variants(chunk.T, chunk.start, rows=chunk.rows, padded=chunk.padded, **kw)


def reachable_variants(budget: int, max_prompt: int, max_rows: int = 1, **kw) -> set:
    """Every :func:`prefill_variants` pair a timed run can reach: chunks of 1..``budget`` tokens (a budget
    shared by several requests in a step cuts any length) after any stored prefix that leaves the chunk
    inside a prompt of at most ``max_prompt`` tokens (the variants depend on the prefix only through 0 and
    the workspace, so the prefixes 0, 1 and the longest stand for all); and packs of 2..``max_rows`` whole
    prompts of up to ``budget // rows`` tokens, padded or not."""
    out = set()
    for T in range(1, min(budget, max_prompt) + 1):
        for start in {0, 1, max_prompt - T}:
            if start + T <= max_prompt:
                out |= prefill_variants(T, start, **kw)
    for rows in range(2, max_rows + 1):
        for T in range(1, min(budget // rows, max_prompt) + 1):
            for padded in {False, T >= 2}:
                out |= prefill_variants(T, 0, rows=rows, padded=padded, **kw)
    return out


def chunk_plan(prompts: list[int], budget: int, max_rows: int = 1) -> list[Chunk]:
    """The prefill forwards (:class:`Chunk`) the engine runs for ``prompts`` (lengths) admitted together,
    oldest first, ``budget`` tokens per step: the engine's own per-step plan
    (``unimem_compile.engine.scheduler.plan_prefill``) replayed step after step until every prompt is stored."""
    from unimem_compile.engine.scheduler import plan_prefill

    done = [0] * len(prompts)
    chunks = []
    while any(d < n for d, n in zip(done, prompts)):
        order = [i for i, n in enumerate(prompts) if done[i] < n]
        for forward in plan_prefill([(done[i], prompts[i]) for i in order], budget, max_rows):
            members = [order[k] for k in forward.requests]
            if forward.packed:
                chunks.append(Chunk(forward.tokens, 0, len(members),
                                    any(prompts[j] != forward.tokens for j in members)))
                for j in members:
                    done[j] = prompts[j]
            else:
                chunks.append(Chunk(forward.tokens, forward.start))
                done[members[0]] += forward.tokens
    return chunks


def group_for_chunk(T: int, start: int, budget: int) -> list[int]:
    """Prompt lengths admitted together whose :func:`chunk_plan` at ``budget`` runs a chunk of ``T`` tokens
    (``1 <= T <= budget``) after ``start`` stored ones: one prompt of ``start + T`` when ``start`` is a whole
    number of budgets; else a request of ``budget - start % budget`` tokens first, which leaves the second
    ``start % budget`` tokens of the first step, so the second's chunks end at ``start``. (Packing needs
    two prompts that fit the step together: ``budget - start % budget`` and ``start + T`` never do, as
    ``start + T > start % budget``.)"""
    if start % budget == 0:
        return [start + T]
    return [budget - start % budget, start + T]


def warm_up_groups(budget: int, max_prompt: int, max_rows: int = 1, **kw) -> list[list[int]]:
    """Prompt lengths to prefill before any timed run, in groups admitted together, whose chunks
    (:func:`chunk_plan` with ``max_rows``) reach every variant of :func:`reachable_variants`.

    Per chunk length class (the shortest and the longest length of each set of :func:`prefill_variants`,
    so a specialisation on the length, were one left, sees both sides of 1 and of 16): the chunk as a
    first chunk, as a later one inside one workspace piece (after a budget's worth of tokens, or after
    one token where that would cross the piece), and as a later one whose history crosses the workspace
    (where ``max_prompt`` holds it). Then two budget splits: a request left one token of the step's
    budget (a one-token first chunk of a longer prompt, then chunks after a one-token prefix). Then packs,
    2 rows first (the batch size Dynamo specialises), per rows and length class (its longest length only:
    with 8 rows the packs are most of the plan): ``rows`` prompts of that length, and the same with the first
    one token shorter (padded). A group is admitted whole only
    where the engine has that many decode rows (``max_rows`` is at most the model's ``max_batch_size``)."""
    workspace = kw["workspace_tokens"]
    by_class: dict[frozenset, list[int]] = {}
    for T in range(1, min(budget, max_prompt) + 1):
        key = frozenset(prefill_variants(T, 0, **kw) | prefill_variants(T, workspace, **kw))
        by_class.setdefault(key, []).append(T)
    lengths = sorted({t for ts in by_class.values() for t in (ts[0], ts[-1])})
    groups = []
    for T in lengths:
        one_piece = budget if budget + T <= workspace else 1
        for start in sorted({0, one_piece, workspace + 1 - T}):
            if start >= 0 and start + T <= max_prompt:
                groups.append(group_for_chunk(T, start, budget))
    for tail in (1, budget):
        if budget >= 2 and 1 + tail <= max_prompt:
            groups.append([budget - 1, 1 + tail])
    for rows in range(2, max_rows + 1):
        packs: dict[frozenset, list[int]] = {}
        for T in range(1, min(budget // rows, max_prompt) + 1):
            key = frozenset(prefill_variants(T, 0, rows=rows, **kw) | prefill_variants(T, 0, rows=rows, padded=True,
                                                                                         **kw))
            packs.setdefault(key, []).append(T)
        for T in sorted({ts[-1] for ts in packs.values()}):  # one length per class: the packs' warm-up is long
            groups.append([T] * rows)
            if T >= 2:
                groups.append([T - 1] + [T] * (rows - 1))
    # each group once, in order; none with a prompt the model could not hold (a budget above max_prompt)
    return [list(g) for g in dict.fromkeys(map(tuple, groups)) if max(g) <= max_prompt]


def warm_up(model, args) -> dict:
    """Compile everything the timed runs can reach before any of them: every decode bucket's greedy step
    (compile, capture) and the prefill chunks of :func:`warm_up_groups`, each group through its own engine
    at the run's ``max_prefill_tokens``. Returns ``{"seconds", "requests", "failed", "chunks", "graphs_compiled",
    "triton_compiles", "triton_kernels_compiled", "uncovered"}``: ``uncovered`` lists the variants of
    :func:`reachable_variants` the groups miss (none, unless the kernels' selection changed)."""
    kw = _variant_geometry(model)
    budget = args.max_prefill_tokens
    max_prompt = args.max_seq_len - WARM_UP_NEW_TOKENS
    max_rows = min(args.max_prefill_rows, model.unimem.max_batch_size)  # the engine's clamp
    groups = warm_up_groups(budget, max_prompt, max_rows, **kw)
    planned = set()
    for group in groups:
        for chunk in chunk_plan(group, budget, max_rows):
            planned |= chunk_variants(chunk, **kw)
    vocab = model.config.vocab_size
    start = time.perf_counter()
    graphs_before = _compiled_graphs()
    failed = 0
    with torch.no_grad(), TritonCompiles() as jit:
        model.unimem.capture()
        for group in groups:
            manager = model.init_continuous_batching(max_prefill_tokens=budget, max_prefill_rows=max_rows)
            for n in group:
                manager.add_request([1 + i % (vocab - 1) for i in range(n)], max_new_tokens=WARM_UP_NEW_TOKENS,
                                    min_new_tokens=WARM_UP_NEW_TOKENS)
            while manager.step():
                pass
            failed += manager.engine.counters["failed"]  # a chunk that raised did not warm its variants
    return {"seconds": time.perf_counter() - start, "requests": sum(len(g) for g in groups), "failed": failed,
            "chunks": sum(len(chunk_plan(g, budget, max_rows)) for g in groups), "max_prefill_rows": max_rows,
            "graphs_compiled": _compiled_graphs() - graphs_before,
            "triton_compiles": len(jit.names) if jit.available else None,
            "triton_kernels_compiled": dict(collections.Counter(jit.names)) if jit.available else None,
            "uncovered": sorted(map(str, reachable_variants(budget, max_prompt, max_rows, **kw) - planned))}


def _variant_geometry(model) -> dict:
    """:func:`prefill_variants`' keywords for ``model``: its KDA head count (the recurrent state's first
    dimension), the workspace ``mla_prefill`` runs with, the GPU's architecture (90 on the CPU: the plan
    of the H200 runs, so the smoke run exercises it)."""
    from unimem_compile.ops.mla_prefill import WORKSPACE_TOKENS

    layers = model.unimem.adapter.state_spec.layers
    device = model.unimem.pool.device
    arch = 90
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        arch = 10 * major + minor
    return {"kda_heads": layers[0].recurrent.shape[0] if layers else 0, "workspace_tokens": WORKSPACE_TOKENS,
            "arch": arch}


# ---------------------------------------------------------------------------------------------- rate
def queued_concurrency(running, waiting) -> dict:
    """Concurrency while requests queue: ``{"queued_fraction": share of the timeline's samples with a request
    waiting, "mean_concurrent_while_queued": mean running requests over those samples (None when there were
    none)}``. With nothing queued, mean concurrency is arrival rate x time in the system (Little's law) and a
    faster system shows less of it; while requests wait, it is what the system can hold. Added 2026-12-02
    (sixteenth session), when the runs at 17.25/s queued little and the plain mean favoured the slower splits."""
    running, waiting = np.asarray(running, dtype=np.float64), np.asarray(waiting)
    if running.shape != waiting.shape:
        raise ValueError(f"running and waiting must be one timeline, got {running.shape} and {waiting.shape} samples")
    queued = waiting > 0
    return {"queued_fraction": float(queued.mean()) if len(queued) else 0.0,
            "mean_concurrent_while_queued": float(running[queued].mean()) if queued.any() else None}


def queue_bounded(waiting) -> bool:
    """The module docstring's rule: the queue over the last quarter of the arrivals never exceeds its peak over
    the first three quarters plus 8 (a timeline of under 4 samples counts as bounded)."""
    waiting = np.asarray(waiting)
    cut = int(len(waiting) * 0.75)
    return bool(len(waiting) < 4 or waiting[cut:].max() <= waiting[:cut].max() + 8)


def find_rate(model, args, run=None) -> dict:
    """The highest arrival rate (requests/s) at which the unified engine keeps its queue bounded on the
    stationary trace, over ``args.rate_iters`` short runs, each stopped at its last arrival.

    The floor ``args.rate_lo`` is run first; while it is unbounded it is halved (a bisection above an
    unbounded floor would return a rate nobody measured), then the interval between the highest bounded rate
    and the lowest unbounded one is bisected. Returns ``{"rate", "bounded", "tried"}``: ``rate`` is the
    highest rate measured bounded, ``bounded`` False when none was (``rate`` is then the last, halved floor,
    never run: raise ``--rate-iters`` or lower ``--rate-lo``). ``run(rate) -> result`` replaces the engine
    run (tests).
    """
    if run is None:
        def run(rate):
            trace = make_trace("stationary", rate, args.seed, args.scale, args.scale_tokens)
            return run_engine(model, "unified", trace, args, drain=False)
    lo, hi, tried, floor_bounded = args.rate_lo, args.rate_hi, [], False
    for _ in range(args.rate_iters):
        rate = (lo + hi) / 2 if floor_bounded else lo
        r = run(rate)
        waiting = np.asarray(r["timeline"]["waiting"])
        bounded = queue_bounded(waiting)
        tried.append({"rate": rate, "bounded": bounded, "max_waiting": int(waiting.max()) if len(waiting) else 0,
                      "seconds": r["seconds"], "confounded_by_jit": r["confounded_by_jit"]})
        if not floor_bounded:
            floor_bounded = bounded
            if not bounded:
                lo, hi = lo / 2, lo
        elif bounded:
            lo = rate
        else:
            hi = rate
    if not floor_bounded:
        warnings.warn(f"--find-rate: no rate in {[t['rate'] for t in tried]} kept the queue bounded; "
                      f"{lo:g}/s was never run (lower --rate-lo or raise --rate-iters)")
    return {"rate": lo, "bounded": floor_bounded, "tried": tried}


# ---------------------------------------------------------------------------------------------- plots
def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(results)
    fig, axes = plt.subplots(2, len(traces), figsize=(7 * len(traces), 7), squeeze=False)
    for col, trace in enumerate(traces):
        for name, r in results[trace].items():
            tl = r.get("timeline") if isinstance(r, dict) else None
            if not tl or not tl["t"]:
                continue
            t = np.asarray(tl["t"])
            occ = (np.asarray(tl["kv_bytes"]) + np.asarray(tl["state_bytes"])) / r["arena_bytes"]
            axes[0][col].plot(t, occ, label=name)
            if name == "unified":
                axes[0][col].fill_between(t, 0, np.asarray(tl["state_bytes"]) / r["arena_bytes"], alpha=0.3,
                                          label="unified: state slots")
            if tl["tokens_per_s"]:
                axes[1][col].plot(t[1:], tl["tokens_per_s"], label=name, lw=0.8)
        axes[0][col].set(title=f"{trace}: arena occupancy", xlabel="s", ylabel="fraction of the arena")
        axes[1][col].set(title=f"{trace}: output tokens/s", xlabel="s", ylabel="tokens/s")
        axes[0][col].legend(fontsize=7)
        axes[1][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------- main
def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine and arena arguments bench_serving and bench_serving_http share (their defaults are
    filled by :func:`apply_presets`)."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-gib", type=float, default=None, help="arena (default 6; 0.002 with --smoke)")
    p.add_argument("--max-batch", type=int, default=None, help="decode rows (default 64; 4 with --smoke)")
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--max-prefill-tokens", type=int, default=4096)
    from unimem_compile.engine import DEFAULT_MAX_PREFILL_ROWS

    p.add_argument("--max-prefill-rows", type=int, default=DEFAULT_MAX_PREFILL_ROWS,
                   help="requests one prefill forward packs at most (the engine's max_prefill_rows; 1: no packing)")
    p.add_argument("--sample-s", type=float, default=0.25, help="seconds between occupancy samples")
    p.add_argument("--drain-timeout-s", type=float, default=3600.0)


def apply_presets(args, rate: float | None = None) -> None:
    """Fill the arguments left unset from the preset of the run: ``--smoke`` (tiny Kimi-Linear, a 600 kB arena,
    prompts scaled by 1/128, CPU-sized) or the run of record (the 8-layer real-geometry model, a 6 GiB arena,
    batch 64, max_seq_len 96k + 512, page 64). ``rate`` (requests/s) is the full run's default arrival rate
    when ``--rate`` is unset (None: leave it unset, find_rate or the trace default decides); the smoke
    preset's is 20/s. Mutates ``args`` (bench_serving_http uses the same presets)."""
    if args.smoke:
        args.model = args.model or "kimi-linear-tiny"
        args.budget_gib = args.budget_gib or 600_000 / GIB
        args.max_batch = args.max_batch or 4
        args.max_seq_len = args.max_seq_len or 160
        args.page_size = args.page_size or 16
        args.scale_tokens = 1 / 128  # chat prompts 0.5..64 tokens, long ones 128..768 -> clipped below
        args.scale = min(args.scale, 0.004)
        args.rate = args.rate or 20.0
        args.max_prefill_tokens = min(args.max_prefill_tokens, 32)
    else:
        args.model = args.model or "kimi-linear-48b-8l"
        args.budget_gib = args.budget_gib or 6.0
        args.max_batch = args.max_batch or 64
        args.max_seq_len = args.max_seq_len or 96 * 1024 + 512
        args.page_size = args.page_size or 64
        args.scale_tokens = 1.0
        if rate is not None:
            args.rate = args.rate or rate


def main(argv=None) -> int:
    t_start = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny model, fp32, aot_eager, tiny traces (CPU check)")
    p.add_argument("--model", default=None, help="preset (default kimi-linear-48b-8l; kimi-linear-tiny with --smoke)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}, "
                   "run in that order")
    p.add_argument("--traces", default=",".join(TRACE_NAMES))
    p.add_argument("--scale", type=float, default=1.0, help="fraction of each phase's requests (same rate)")
    p.add_argument("--rate", type=float, default=None, help="arrivals per second (every system gets it)")
    p.add_argument("--find-rate", action="store_true", help="bisect the rate on the unified engine first")
    p.add_argument("--rate-lo", type=float, default=0.5)
    p.add_argument("--rate-hi", type=float, default=64.0)
    p.add_argument("--rate-iters", type=int, default=5)
    add_engine_arguments(p)
    p.add_argument("--sim-tick-s", type=float, default=0.05, help="seconds per simulator tick for simbest")
    p.add_argument("--step-check", action="store_true", help="decode step at 32 rows: engine vs runner generate()")
    p.add_argument("--prefill-probe", action="store_true",
                   help="one request's prefill at a time: generate() vs the engine on this thread vs a started "
                        "manager, with a profile (prefill_probe); runs after the warm-up, before the traces")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="seconds after start past which no further system starts (each is recorded as skipped; "
                        "stock_static starts no further batch); the JSON is written after every system, so a run "
                        "cut short keeps what it measured")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serving_<date>.json; with "
                   "--smoke <tmp>/bench_serving_smoke/serving_smoke.json)")
    p.add_argument("--plots", default=None, help="folder of serving.png (default benchmarks/plots; with --smoke the "
                   "JSON's folder)")
    args = p.parse_args(argv)
    apply_presets(args)
    systems = [s for s in args.systems.split(",") if s]
    bad = sorted(set(systems) - set(SYSTEMS))
    if bad:
        p.error(f"unknown systems {bad}; systems: {','.join(SYSTEMS)}")
    args.keep_stock = bool({"stock_cb", "stock_static"} & set(systems))
    here = os.path.dirname(os.path.abspath(__file__))
    # a smoke run never lands on the results of record (same date, same name): its defaults are a temp folder
    scratch = os.path.join(tempfile.gettempdir(), "bench_serving_smoke")
    out = args.out or (os.path.join(scratch, "serving_smoke.json") if args.smoke else
                       os.path.join(here, "results", f"serving_{time.strftime('%Y-%m-%d')}.json"))
    plots = args.plots or (scratch if args.smoke else os.path.join(here, "plots"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.makedirs(plots, exist_ok=True)

    def past_deadline() -> bool:
        return args.deadline_s is not None and time.perf_counter() - t_start > args.deadline_s

    def save() -> None:
        record["elapsed_s"] = time.perf_counter() - t_start
        with open(out, "w") as f:
            json.dump(record, f, indent=1, default=str)

    model, stock = build(args)
    from unimem_compile.ops.kda import kda_prefill_backend
    record = {"config": {k: v for k, v in vars(args).items()}, "machine": platform.node(),
              "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "build_s": time.perf_counter() - t_start,
              "kda_prefill": kda_prefill_backend()}  # "reference" on CUDA = ~5x slower prefills (2026-12-02)
    print(f"KDA prefill: {json.dumps(record['kda_prefill'])}", flush=True)
    if (any(s not in ("stock_cb", "stock_static") for s in systems) or args.find_rate or args.step_check
            or args.prefill_probe):
        record["warm_up"] = warm_up(model, args)  # compiles and captures outside every timed run
        record["warm_up_s"] = record["warm_up"]["seconds"]
        w = record["warm_up"]
        print(f"warm-up {w['seconds']:.1f} s: {w['requests']} requests ({w['failed']} failed), {w['chunks']} "
              f"prefill chunks, {w['graphs_compiled']} graphs, {w['triton_compiles']} Triton compiles "
              f"{json.dumps(w['triton_kernels_compiled'])}; uncovered {w['uncovered']}", flush=True)
    if args.prefill_probe:
        record["prefill_probe"] = prefill_probe(model, args)
        save()
    if args.find_rate:
        record["rate_search"] = find_rate(model, args)
        args.rate = record["rate_search"]["rate"]
        print("rate search", json.dumps(record["rate_search"]), flush=True)
    traces = [t for t in args.traces.split(",") if t]
    if args.rate is None and traces:
        p.error("--rate is required (or --find-rate)")
    record["rate"] = args.rate
    record["rate_source"] = "--find-rate" if args.find_rate else "--rate"
    if args.step_check:  # before the traces: its generate() compiles batch-32 prefill graphs no engine run uses
        record["step_check"] = step_check(model, args)
        print("step check", json.dumps(record["step_check"]), flush=True)
    results = record["results"] = {}
    if not traces:  # a probe or a rate search alone
        save()
        print(f"wrote {out} in {time.perf_counter() - t_start:.0f} s")
        return 0
    for name in traces:
        trace = make_trace(name, args.rate, args.seed, args.scale, args.scale_tokens)
        if args.smoke:  # the tiny model's max_seq_len
            for r in trace:
                r["output"] = max(r["output"], 4)  # a few decode steps per request
                r["prompt"] = int(min(r["prompt"], args.max_seq_len - r["output"] - 1))
        results[name] = {}
        for system in systems:
            if past_deadline():
                results[name][system] = {"skipped": f"--deadline-s {args.deadline_s} passed before it started"}
                print(f"{name:10s} {system:12s} skipped (deadline)", flush=True)
                continue
            t0 = time.perf_counter()
            if system == "stock_cb":
                r = run_stock_cb(stock, trace, args)
            elif system == "stock_static":
                r = run_stock_static(stock, trace, args, deadline=(None if args.deadline_s is None
                                                                   else t_start + args.deadline_s))
            elif system == "simbest":
                share = sim_best_share(model, trace, args)
                r = run_engine(model, system, trace, args, share)
            else:
                r = run_engine(model, system, trace, args)
            r["wall_s"] = time.perf_counter() - t0
            results[name][system] = r
            brief = {k: r[k] for k in ("mean_concurrent", "peak_concurrent", "mean_concurrent_while_queued",
                                       "queued_fraction", "preemptions", "ttft_p99_s", "output_tokens_per_s",
                                       "refused_with_room", "row_waits", "leaked_pages", "graphs_compiled_in_run",
                                       "triton_compiles_in_run", "kda_graphs_captured_in_run", "confounded_by_jit",
                                       "kv_share", "error")
                     if k in r}
            print(f"{name:10s} {system:12s} {json.dumps(brief)}", flush=True)
            if "time_split" in r:
                ts = r["time_split"]
                print(f"{name:10s} {system:12s} time: " + ", ".join(
                    f"{k} {ts[k]:.2f} s" for k in ("decode_s", "prefill_s", "other_step_s", "idle_s"))
                    + f" of {r['seconds']:.2f} s; {ts['steps']} steps, {ts['prefill_chunks']} prefill forwards of "
                    f"{ts['prefill_tokens']} tokens, {ts['compactions']} compactions", flush=True)
            pf = r.get("prefill_forwards")
            if pf:
                kinds = ("all", "first_chunk", "later_chunk", "final", "not_final", "under_1k_tokens", "from_1k_tokens",
                         "packed")
                by_kind = ", ".join(f"{k} {pf[k]['p50_ms'] or 0:.1f}/{pf[k]['p90_ms'] or 0:.1f}/"
                                    f"{pf[k]['max_ms'] or 0:.1f} (n={pf[k]['forwards']})" for k in kinds)
                print(f"{name:10s} {system:12s} prefill forwards (ms p50/p90/max): {by_kind}; "
                      f"{pf['ms_per_1k_tokens_p50'] or 0:.1f} ms per 1k tokens p50, corr with rows decoding "
                      f"{pf['corr_ms_rows_decoding']}; slowest {json.dumps(pf['slowest'])}", flush=True)
            if r.get("confounded_by_jit"):
                print(f"{name:10s} {system:12s} WARNING: confounded by JIT "
                      f"{json.dumps(r.get('triton_kernels_compiled_in_run'))}", flush=True)
            ratios = comparison(results[name])
            if ratios is not None:
                results[name]["ratios"] = ratios
            save()
        if "ratios" in results[name]:
            print(f"{name:10s} ratios {json.dumps(results[name]['ratios'])}", flush=True)
    save()
    plot(results, os.path.join(plots, "serving.png"))
    print(f"wrote {out} and {os.path.join(plots, 'serving.png')} in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
