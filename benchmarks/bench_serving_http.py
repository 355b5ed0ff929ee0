"""Serving over HTTP: bench_serving's stationary trace sent to ``unimem-compile serve``'s app by an async
load generator, against the same trace driven into the engine in-process.

Model ``kimi-linear-48b-8l`` (8 layers, 2 MLA + 6 KDA, the real per-layer geometry), bf16, random weights, a
6 GiB arena (bench_serving's defaults, and its :func:`make_trace`: prompt and output lengths, Poisson
arrivals at ``--rate``, 2% long-context requests). The same compiled model runs, in this order:

0. ``bench_serving.warm_up``: every decode bucket's step and the prefill graphs are built before either
   measured run;
1. in-process: ``bench_serving.run_engine`` (the engine's own benchmark: requests added at their arrival
   times, results read from the manager);
2. over HTTP: the server's app (:mod:`unimem_compile.serve`, the same code ``serve`` runs) on a uvicorn
   thread of this process, and a load generator in a SEPARATE process (``--client``; its CPU must not slow
   the server) that posts each request at its arrival time to ``/v1/completions`` (token-id prompt,
   ``max_tokens = min_tokens =`` the trace's output length, greedy, ``stream: true`` with
   ``include_usage``) over one connection per request (httpx2, or httpx where httpx2 is missing: the
   client uses only their common API (AsyncClient, Limits, stream, aiter_lines), no connection limit).

Reported for both: output tokens/s, requests/s, TTFT and TPOT p50 / p99 (seconds; TTFT from the request's
scheduled arrival to its first token, TPOT = (last token - first token) / (tokens - 1)); and
``http_overhead``: 1 - HTTP tokens/s / in-process tokens/s (target: <= 0.10), the TTFT / TPOT ratios, and the
SSE events per request (the server sends every token that is ready when it wakes in one event, so a busy
server sends several tokens per event).

GPU (one H200), reduced (a few minutes): python benchmarks/bench_serving_http.py --scale 0.05 --rate R
GPU, full: --scale 1 (3000 requests each way; at a rate near capacity budget ~30 minutes per way).
``--duration S`` caps each way's arrivals at S seconds (the trace is cut, the rate kept).
CPU smoke (tiny model, fp32, aot_eager, a handful of requests): python benchmarks/bench_serving_http.py --device cpu --smoke
CPU, decode-heavy (~60 requests of 24..96 tokens on 16 rows, ~20 s a way; --scale / --scale-tokens given win over
--smoke's): --device cpu --smoke --scale 0.05 --scale-tokens 0.0078125 --output-factor 24 --max-batch 16
--max-seq-len 256 --budget-gib 0.01 --duration 3 --rate 20 --repeat 3 (the 2-core machine is shared: compare the
engine's decode_ms_per_step of both ways as well as tokens/s, and state the spread of the rounds).
The client imports httpx2, or httpx where httpx2 is missing (the GPU machine: httpx 0.28, no httpx2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serving  # noqa: E402 - the engine's benchmark: trace, model, in-process run

GIB = 1 << 30


def _pct(values, q):
    return float(np.percentile(values, q)) if len(values) else None


# ---------------------------------------------------------------------------------------------- client
async def _client_run(url: str, requests: list[dict], timeout_s: float) -> dict:
    """Post every request at its arrival time; returns per-request timings (client process)."""
    try:
        import httpx2 as httpx
    except ImportError:  # the GPU machine has httpx 0.28, not httpx2 (whose httpcore2 wheel needs truststore)
        import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    out = []
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout_s) as client:
        start = time.perf_counter()

        async def one(r):
            delay = start + r["arrival"] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = {"model": r["model"], "prompt": r["ids"], "max_tokens": r["output"], "min_tokens": r["output"],
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            first = last = None
            events, tokens, error = 0, 0, None
            try:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        error = f"{resp.status_code}: {(await resp.aread()).decode()[:200]}"
                    else:
                        async for line in resp.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            chunk = json.loads(line[6:])
                            if chunk.get("usage"):
                                tokens = chunk["usage"]["completion_tokens"]
                            elif chunk["choices"]:
                                now = time.perf_counter()
                                events += 1
                                first = first or now
                                last = now
            except Exception as e:  # noqa: BLE001 - recorded: a benchmark reports failures, it does not stop
                error = f"{type(e).__name__}: {e}"
            out.append({"i": r["i"], "arrival": start + r["arrival"], "first": first, "last": last,
                        "tokens": tokens, "events": events, "error": error})

        await asyncio.gather(*(one(r) for r in requests))
        end = time.perf_counter()
    return {"start": start, "end": end, "requests": out}


def client_main(args) -> int:
    with open(args.client) as f:
        job = json.load(f)
    result = asyncio.run(_client_run(job["url"], job["requests"], job["timeout_s"]))
    with open(job["out"], "w") as f:
        json.dump(result, f)
    return 0


def summarise_http(result: dict) -> dict:
    reqs = result["requests"]
    ok = [r for r in reqs if r["error"] is None and r["first"] is not None]
    ttft = [r["first"] - r["arrival"] for r in ok]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    seconds = max(r["last"] for r in ok) - result["start"] if ok else float("nan")
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(reqs), "served": len(ok), "errors": [r["error"] for r in reqs if r["error"]][:10],
            "n_errors": sum(1 for r in reqs if r["error"]),
            "output_tokens_per_s": tokens / seconds, "requests_per_s": len(ok) / seconds, "seconds": seconds,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
            "events_per_request": float(np.mean([r["events"] for r in ok])) if ok else None,
            "tokens_per_event": tokens / max(1, sum(r["events"] for r in ok))}


# ---------------------------------------------------------------------------------------------- server side
def run_http(model, trace: list[dict], args) -> dict:
    """Serve ``trace`` over HTTP: the app on a uvicorn thread here, the load generator in a subprocess."""
    from unimem_compile.serve import ManagerEngine, ServerState, ServerThread
    from unimem_compile.serve.server import warm_up
    from unimem_compile.serve.text import ByteCodec

    rng = np.random.default_rng(args.seed + 1)  # bench_serving.run_engine's prompts: the same token ids
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, r["prompt"]).tolist() for r in trace]
    codec = ByteCodec(vocab)
    manager = model.init_continuous_batching(max_prefill_tokens=args.max_prefill_tokens,
                                             max_prefill_rows=args.max_prefill_rows)
    engine = ManagerEngine(manager, args.max_seq_len)
    with torch.no_grad():
        warm_up(engine, codec)
    state = ServerState(model_name=args.model, codec=codec, max_seq_len=args.max_seq_len, engine=engine, ready=True)
    server = ServerThread(state, log_level="warning", shutdown_timeout=5).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            job = {"url": server.url, "timeout_s": args.drain_timeout_s, "out": os.path.join(tmp, "client.json"),
                   "requests": [{**r, "ids": p, "model": args.model} for r, p in zip(trace, prompts)]}
            with open(os.path.join(tmp, "job.json"), "w") as f:
                json.dump(job, f)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--client", os.path.join(tmp, "job.json")],
                           check=True, timeout=args.drain_timeout_s + 120)
            with open(job["out"]) as f:
                result = json.load(f)
        metrics = engine.metrics()
    finally:
        server.stop()
        engine.close(timeout=60)
    out = summarise_http(result)
    stats = model.unimem.stats()
    counters = manager.engine.counters  # the engine's own step timings, as bench_serving.run_engine reports them
    out.update(decode_ms_per_step=1e3 * counters["decode_s"] / max(1, counters["decode_steps"]),
               mean_rows_per_step=counters["decode_row_steps"] / max(1, counters["decode_steps"]))
    out.update(preemptions=metrics.preemptions, leaked_pages=stats["kv_pages_used"],
               leaked_slots=stats["state_slots_used"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the load generator's process
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny model, fp32, aot_eager, a few requests (CPU check)")
    p.add_argument("--model", default=None, help="preset (default kimi-linear-48b-8l; kimi-linear-tiny with --smoke)")
    p.add_argument("--scale", type=float, default=None,
                   help="fraction of the stationary trace's 3000 requests (default 1; --smoke: 0.004)")
    p.add_argument("--scale-tokens", type=float, default=None,
                   help="factor on every prompt and output length (default 1; --smoke: 1/128)")
    p.add_argument("--output-factor", type=float, default=1.0,
                   help="a further factor on the output lengths (a decode-heavy CPU run: short prompts, long replies)")
    p.add_argument("--duration", type=float, default=None, help="keep only the arrivals of the first S seconds")
    p.add_argument("--rate", type=float, default=None, help="arrivals per second (default 4; 20 with --smoke)")
    bench_serving.add_engine_arguments(p)
    p.add_argument("--repeat", type=int, default=1, help="rounds of (in-process, HTTP) on the same model (spread)")
    p.add_argument("--skip-in-process", action="store_true", help="HTTP only (no baseline, no overhead figure)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serving_http_<date>.json)")
    args = p.parse_args(argv)
    if args.client:
        return client_main(args)
    scale, scale_tokens = args.scale, args.scale_tokens
    args.scale = 1.0 if scale is None else scale
    bench_serving.apply_presets(args, rate=4.0)
    # given explicitly, they win over --smoke's (a CPU run heavier than the smoke check)
    args.scale = args.scale if scale is None else scale
    args.scale_tokens = args.scale_tokens if scale_tokens is None else scale_tokens
    args.keep_stock = False
    trace = bench_serving.make_trace("stationary", args.rate, args.seed, args.scale, args.scale_tokens)
    if args.duration is not None:
        trace = [r for r in trace if r["arrival"] <= args.duration] or trace[:1]
    for r in trace:  # as bench_serving: a request must fit max_seq_len
        r["output"] = int(min(max(1, round(r["output"] * args.output_factor)), args.max_seq_len // 2))
        r["prompt"] = int(min(r["prompt"], args.max_seq_len - r["output"] - 1))
    model, _ = bench_serving.build(args)
    from unimem_compile.ops.kda import kda_prefill_backend
    warm_up_s = bench_serving.warm_up(model, args)  # every decode bucket's step and the prefill graphs
    result = {"model": args.model, "device": args.device, "torch": torch.__version__, "rate": args.rate,
              "scale": args.scale, "scale_tokens": args.scale_tokens,
              "output_factor": args.output_factor, "duration": args.duration, "requests": len(trace),
              "budget_bytes": int(args.budget_gib * GIB), "max_batch": args.max_batch, "warm_up_s": warm_up_s,
              "kda_prefill": kda_prefill_backend()}
    rounds = []
    for _ in range(args.repeat):  # in-process then HTTP, each round on the same compiled model
        one = {}
        if not args.skip_in_process:
            inproc = bench_serving.run_engine(model, "unified", trace, args)
            inproc.pop("timeline", None)
            one["in_process"] = inproc
        one["http"] = http = run_http(model, trace, args)
        if not args.skip_in_process:
            base = one["in_process"]
            one["http_overhead"] = {
                "tokens_per_s_loss": 1 - http["output_tokens_per_s"] / base["output_tokens_per_s"],
                "ttft_p50_ratio": (http["ttft_p50_s"] / base["ttft_p50_s"]) if base["ttft_p50_s"] else None,
                "tpot_p50_ratio": (http["tpot_p50_s"] / base["tpot_p50_s"]) if base["tpot_p50_s"] else None,
                "target_tokens_per_s_loss": 0.10,
            }
        rounds.append(one)
    result.update(rounds[0])  # the first round at the top level, as before --repeat
    if args.repeat > 1:
        result["rounds"] = rounds
    text = json.dumps(result, indent=2)
    print(text)
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"serving_http_{time.strftime('%Y-%m-%d')}{'_smoke' if args.smoke else ''}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text + "\n")
    return 0 if all(r["http"]["n_errors"] == 0 for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
