"""How the phased trace's capacity ratio depends on the size of its long-context phase (issue 9).

The phased trace of record (``simulate.phased_trace``: 40 long-context requests between two 60-tick chat
bursts) keeps the unified pool at 1.19x (mean) / 1.29x (under load) the concurrent requests of the best
static split chosen in hindsight. This runs the same simulation (bench_capacity's systems, scheduler and
geometry) with the long-context phase scaled: ``n_long`` requests arriving over ``n_long / 4`` ticks, the
chat phases unchanged, and reports unified / best static (coarse grid 0.10-0.90 step 0.05, then step 0.01
around the best) for each size. It changes nothing in the benchmark of record.

usage: python benchmarks/capacity_sensitivity.py [--n-long 40 80 160] [--seed 0] [--out sens.json]
       (``--quick``: bench_capacity's --quick geometry and traces, n_long requests over n_long ticks; a smoke
       run of seconds, for the tests)
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_capacity as bc

from unimem_compile.sim.simulate import TRACES, phased_trace


def _simulate(names, grid, a, args) -> tuple[dict, dict]:
    """Unified and static-split summaries of each named trace: (splits[name][kv_fraction], unified[name])."""
    with multiprocessing.get_context("fork").Pool(max(1, args.jobs)) as pool:
        jobs = [(t, "unified", None, a) for t in names] + [(t, "static", f, a) for t in names for f in grid]
        splits: dict[str, dict] = {t: {} for t in names}
        unified = {}
        for (t, kind, f), summary, _ in pool.map(bc._run, jobs):
            if kind == "unified":
                unified[t] = summary
            else:
                splits[t][f] = summary
        fine = bc._fine_splits(splits) if not args.quick else set()
        for (t, kind, f), summary, _ in pool.map(bc._run, [(t, "static", f, a) for t, f in sorted(fine)]):
            splits[t][f] = summary
    return splits, unified


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-long", type=int, nargs="+", default=[40, 80, 160])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="tiny traces and a 4 GiB budget (seconds)")
    args = p.parse_args(argv)
    # bench_capacity._run builds every trace as TRACES[name](seed) (its own "quick" switch stays off: the
    # quick traces are registered here under their own names)
    a = {"geometry": "kimi-linear-48b", "budget_gib": 4.0 if args.quick else 40.0, "page_size": 64,
         "tokens_per_tick": 16, "reserve": 0.01, "seed": args.seed, "quick": False}
    grid = bc.QUICK_GRID if args.quick else bc.COARSE_GRID
    names = []
    for n in args.n_long:
        name = f"phased_long{n}"
        if args.quick:  # bench_capacity's quick phased trace, with n_long requests over n_long ticks
            trace = functools.partial(phased_trace, chat_ticks=10, chat_rate=8.0, n_long=n, long_ticks=n, gap_ticks=5)
        else:
            trace = functools.partial(phased_trace, n_long=n, long_ticks=max(1, n // 4))
        TRACES[name] = trace  # forked workers see it
        names.append(name)
    rows = {}
    try:
        splits, unified = _simulate(names, grid, a, args)
    finally:  # the extra traces must not outlive this run (bench_capacity iterates over TRACES)
        for name in names:
            TRACES.pop(name, None)
    for n, t in zip(args.n_long, names):
        row = {"n_long": n}
        for metric in ("mean_concurrent", "mean_concurrent_loaded"):
            f, best = bc._best(splits[t], metric)
            row[metric] = {"unified": unified[t][metric], "best_static": best[metric], "best_kv_fraction": f,
                           "ratio": bc._ratio(unified[t][metric], best[metric])}
        rows[n] = row
        print(f"n_long {n:4d}: mean {bc._x(row['mean_concurrent']['ratio'])} (best split "
              f"{row['mean_concurrent']['best_kv_fraction']:.2f}), under load "
              f"{bc._x(row['mean_concurrent_loaded']['ratio'])} (best split "
              f"{row['mean_concurrent_loaded']['best_kv_fraction']:.2f})", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"seed": args.seed, "quick": args.quick, "conditions": a, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
