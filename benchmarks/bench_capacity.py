"""Capacity: how many requests one byte budget serves, unified pool vs static splits vs a padded hybrid pool.

CPU only, no model weights. Every memory system is the library's real pool code on the ``meta`` device
(see :mod:`unimem_compile.sim.simulate` for the scheduler, the systems and the traces). For each trace
(stationary, phased) it runs

* the unified pool;
* static two-pool splits over a grid of KV shares (0.10 ... 0.90 step 0.05, then step 0.01 around the
  best; 0.3, 0.5, 0.7 with ``--quick``), reporting the best in hindsight and the fixed 50/50;
* one pool whose attention blocks are padded to the per-layer state size (``padded_group_bytes`` model);

and writes ``benchmarks/results/capacity_<date>.json``, ``benchmarks/plots/capacity_occupancy.png`` (the
unified arena over time: state slots from the bottom, KV pages from the top, the gap between) and
``benchmarks/plots/capacity_comparison.png``, then prints a table.

    python benchmarks/bench_capacity.py                 # 40 GiB, Kimi-Linear-48B, seed 0 (~6 min, 2 cores)
    python benchmarks/bench_capacity.py --quick --out /tmp/cap.json --plots /tmp   # seconds
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

from unimem_compile.errors import GeometryError
from unimem_compile.pool import GEOMETRIES, geometry
from unimem_compile.sim.simulate import (
    GIB,
    TRACES,
    PaddedHybridSystem,
    StaticSplitSystem,
    UnifiedSystem,
    phased_trace,
    simulate,
    stationary_trace,
)

#: the capacity targets of issue 9: unified / best static split, on the mean concurrent requests
TARGETS = {"phased": 1.3, "stationary": 0.98}
COARSE_GRID = [round(0.10 + 0.05 * i, 2) for i in range(17)]
QUICK_GRID = [0.3, 0.5, 0.7]


def _trace(name: str, seed: int, quick: bool):
    if not quick:
        return TRACES[name](seed)
    if name == "stationary":
        return stationary_trace(seed, ticks=30, rate=6.0, long_fraction=0.03)
    return phased_trace(seed, chat_ticks=10, chat_rate=8.0, n_long=3, long_ticks=3, gap_ticks=5)


def _run(job: tuple) -> tuple:
    """One simulation (a process-pool job): ``(trace, kind, kv_fraction, args)`` -> ``(key, summary,
    timeline)``."""
    trace_name, kind, fraction, a = job
    kv, state = geometry(a["geometry"])
    budget = int(a["budget_gib"] * GIB)
    if kind == "unified":
        system = UnifiedSystem(kv, state, budget, a["page_size"])
    elif kind == "padded":
        try:
            system = PaddedHybridSystem(kv, state, budget)
        except GeometryError:  # the budget cannot hold the padded pool's minimum
            return (trace_name, kind, fraction), None, None
    else:
        try:
            system = StaticSplitSystem(kv, state, budget, fraction, a["page_size"])
        except GeometryError:  # one of the two pools would be below its minimum size: not a candidate
            return (trace_name, kind, fraction), None, None
    trace = _trace(trace_name, a["seed"], a["quick"])
    r = simulate(system, trace, kv, state, tokens_per_tick=a["tokens_per_tick"], reserve_fraction=a["reserve"],
                 page_size=a["page_size"])
    keep = kind == "unified" or a.get("keep_all_timelines", False)
    return (trace_name, kind, fraction), r.summary(), (r.timeline if keep else None)


def _trace_stats(trace) -> dict:
    chat = [r for r in trace if r.kind == "chat"]
    long = [r for r in trace if r.kind == "long"]
    return {
        "requests": len(trace),
        "chat": len(chat),
        "long": len(long),
        "last_arrival_tick": max(r.arrival for r in trace),
        "chat_prompt_median": int(np.median([r.prompt for r in chat])) if chat else 0,
        "chat_output_median": int(np.median([r.output for r in chat])) if chat else 0,
        "long_prompt_median": int(np.median([r.prompt for r in long])) if long else 0,
        "long_output_median": int(np.median([r.output for r in long])) if long else 0,
        "prompt_tokens": sum(r.prompt for r in trace),
        "output_tokens": sum(r.output for r in trace),
    }


def _best(splits: dict[float, dict], metric: str) -> tuple[float, dict]:
    """The split with the highest ``metric`` among those that served the whole trace (nothing rejected); when
    every split rejects requests (a budget below the largest request's pool share), among those that
    rejected the fewest (its ``rejected`` count is in the results)."""
    built = {f: s for f, s in splits.items() if s is not None}  # None: the budget cannot hold that split
    fewest = min(s["rejected"] for s in built.values())
    eligible = {f: s for f, s in built.items() if s["rejected"] == fewest}
    # a split whose metric is None (no tick under load) ranks last for that metric
    f = max(eligible, key=lambda k: (eligible[k][metric] is not None, eligible[k][metric] or 0.0, -abs(k - 0.5)))
    return f, eligible[f]


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing (a system never under load) or b is 0."""
    return a / b if a is not None and b else None


def _fine_splits(splits: dict[str, dict[float, dict]]) -> set[tuple[str, float]]:
    """(trace, KV fraction) pairs not yet simulated within +-0.04 (step 0.01) of the best coarse split of each
    metric: the refinement step of the hindsight search."""
    fine = set()
    for t, by_fraction in splits.items():
        for metric in ("mean_concurrent", "mean_concurrent_loaded"):
            f0, _ = _best(by_fraction, metric)
            fine |= {(t, round(f0 + d / 100, 2)) for d in range(-4, 5)
                     if 0.05 <= f0 + d / 100 <= 0.95 and round(f0 + d / 100, 2) not in by_fraction}
    return fine


def run(args) -> dict:
    a = vars(args).copy()
    jobs = max(1, args.jobs)
    results: dict[str, dict] = {}
    timelines: dict[str, dict] = {}
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        first = [(t, k, None, a) for t in TRACES for k in ("unified", "padded")]
        first += [(t, "static", f, a) for t in TRACES for f in (QUICK_GRID if args.quick else COARSE_GRID)]
        out = pool.map(_run, first)
        splits: dict[str, dict[float, dict]] = {t: {} for t in TRACES}
        for (t, kind, f), summary, timeline in out:
            if kind == "static":
                splits[t][f] = summary
            else:
                results.setdefault(t, {})[kind] = summary
                if timeline is not None:
                    timelines[t] = timeline
        fine = _fine_splits(splits) if not args.quick else set()
        for (t, kind, f), summary, _ in pool.map(_run, [(t, "static", f, a) for t, f in sorted(fine)]):
            splits[t][f] = summary

    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "versions": _versions(),
        "command": "python " + " ".join(sys.argv),
        "conditions": {
            "geometry": args.geometry,
            "budget_bytes": int(args.budget_gib * GIB),
            "page_size": args.page_size,
            "tokens_per_tick": args.tokens_per_tick,
            "reserve_fraction": args.reserve,
            "seed": args.seed,
            "quick": args.quick,
            "scheduler": "FCFS continuous batching, no overtaking; on a failed growth the newest running "
                         "request is retracted (recomputed later); one tick = tokens_per_tick decode steps of "
                         "every running request; prefill and step cost not modelled",
            "pools": "real UnifiedPool / MultiEndedAllocator on the meta device (no arena storage)",
        },
        "traces": {},
    }
    for t in TRACES:
        trace = _trace(t, args.seed, args.quick)
        half = splits[t].get(0.5)  # None when the budget cannot hold a 50/50 split
        entry = {"trace": _trace_stats(trace), "unified": results[t]["unified"],
                 "padded_hybrid": results[t]["padded"], "static_50_50": half,
                 "static_grid": {f"{f:.2f}": ({k: s[k] for k in ("mean_concurrent", "mean_concurrent_loaded",
                                                                  "peak_concurrent", "rejected", "retracted")}
                                              if s is not None else "below the minimum pool sizes")
                                 for f, s in sorted(splits[t].items())}}
        for metric in ("mean_concurrent", "mean_concurrent_loaded"):
            f, best = _best(splits[t], metric)
            entry[f"best_static_by_{metric}"] = best
            u = results[t]["unified"][metric]
            entry[f"ratio_{metric}"] = {
                "unified/best_static": _ratio(u, best[metric]),
                "unified/static_50_50": _ratio(u, half[metric] if half else None),
                "unified/padded_hybrid": _ratio(u, results[t]["padded"][metric] if results[t]["padded"] else None),
                "best_kv_fraction": f,
            }

        def met(ratio):  # None: not measurable (e.g. no tick under load for one of the two)
            return None if ratio is None else ratio >= TARGETS[t]

        entry["targets"] = {
            "unified/best_static >=": TARGETS[t],
            "met_on_mean_concurrent": met(entry["ratio_mean_concurrent"]["unified/best_static"]),
            "met_on_mean_concurrent_loaded": met(entry["ratio_mean_concurrent_loaded"]["unified/best_static"]),
            "unified_refused_with_room": results[t]["unified"]["refused_with_room"]
            + results[t]["unified"]["retracted_with_room"],
        }
        report["traces"][t] = entry
    report["_timelines"] = timelines
    return report


def _versions() -> dict:
    import torch

    import unimem_compile

    out = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
           "unimem_compile": getattr(unimem_compile, "__version__", "?")}
    try:
        out["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=os.path.dirname(__file__),
                                    capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git"] = None
    return out


def _systems(entry: dict) -> list[tuple[str, dict]]:
    f = entry["ratio_mean_concurrent"]["best_kv_fraction"]
    best = f"best static ({round(100 * f)}/{round(100 * (1 - f))} KV/state)"
    return [("unified", entry["unified"]),
            (best, entry["best_static_by_mean_concurrent"]),
            ("static 50/50", entry["static_50_50"]),  # None: the budget cannot hold that split
            ("padded hybrid", entry["padded_hybrid"])]


def _f(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.3f}"


def format_table(report: dict) -> str:
    head = (f"{'trace':<11}{'system':<32}{'peak':>6}{'mean':>8}{'loaded':>8}{'refused':>8}{'w/room':>7}"
            f"{'retract':>8}{'util':>7}{'useful':>7}{'u@load':>7}{'ticks':>7}")
    lines = [head, "-" * len(head)]
    for t, entry in report["traces"].items():
        for name, s in _systems(entry):
            if s is None:
                lines.append(f"{t:<11}{name:<32}  (the budget cannot hold this split's minimum pool sizes)")
                continue
            lines.append(f"{t:<11}{name:<32}{s['peak_concurrent']:>6}{s['mean_concurrent']:>8.1f}"
                         f"{_f(s['mean_concurrent_loaded'], '.1f'):>8}{s['refused']:>8}"
                         f"{s['refused_with_room'] + s['retracted_with_room']:>7}{s['retracted']:>8}"
                         f"{s['mean_allocated_fraction']:>7.1%}{s['mean_useful_fraction']:>7.1%}"
                         f"{_f(s['mean_useful_fraction_loaded'], '.1%'):>7}{s['ticks']:>7}")
        r1, r2 = entry["ratio_mean_concurrent"], entry["ratio_mean_concurrent_loaded"]
        lines.append(f"{'':<11}unified / best static: {_x(r1['unified/best_static'])} (mean), "
                     f"{_x(r2['unified/best_static'])} (loaded; best split {r2['best_kv_fraction']:.2f}); "
                     f"target >= {TARGETS[t]}; unified / 50-50 {_x(r1['unified/static_50_50'])}; "
                     f"unified / padded {_x(r1['unified/padded_hybrid'])}")
    return "\n".join(lines)


def plot(report: dict, plots_dir: str) -> list[str]:
    """Write the occupancy and comparison PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plots_dir, exist_ok=True)
    budget = report["conditions"]["budget_bytes"]
    traces = list(report["traces"])
    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 3.6 * len(traces)), squeeze=False)
    for ax, t in zip(axes[:, 0], traces):
        tl = {k: np.asarray(v, dtype=np.float64) / GIB for k, v in report["_timelines"][t].items()
              if k not in ("running", "waiting")}
        x = np.arange(len(tl["state_end"]))
        top = budget / GIB
        state_live_top = tl["state_end"] - tl["state_holes"]
        kv_live_bottom = tl["kv_start"] + tl["kv_holes"]
        ax.fill_between(x, 0, state_live_top, color="#1f77b4", lw=0, label="state slots (live)", step="post")
        ax.fill_between(x, state_live_top, tl["state_end"], color="#aec7e8", lw=0, label="state holes", step="post")
        ax.fill_between(x, tl["kv_start"], kv_live_bottom, color="#ffbb78", lw=0, label="KV holes", step="post")
        ax.fill_between(x, kv_live_bottom, top, color="#ff7f0e", lw=0, label="KV pages (live)", step="post")
        ax.set_ylim(0, top)
        ax.set_xlim(0, len(x))
        ax.set_ylabel("arena offset (GiB)")
        ax.set_title(f"{t} trace: unified arena occupancy (white: the free gap)")
        twin = ax.twinx()
        twin.plot(x, report["_timelines"][t]["running"], color="black", lw=0.8, label="running requests")
        twin.set_ylabel("running requests")
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=5)
    axes[-1, 0].set_xlabel(f"tick ({report['conditions']['tokens_per_tick']} decode tokens per running request)")
    fig.tight_layout()
    occ = os.path.join(plots_dir, "capacity_occupancy.png")
    fig.savefig(occ, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["#2ca02c", "#1f77b4", "#9467bd", "#d62728"]
    for ax, metric, title in ((axes[0], "mean_concurrent", "mean concurrent requests (whole run)"),
                              (axes[1], "mean_concurrent_loaded", "mean concurrent requests while a queue waits")):
        width = 0.2
        for i, t in enumerate(traces):
            systems = _systems(report["traces"][t])
            for j, (name, s) in enumerate(systems):
                if j == 1:  # the best split for this metric
                    s = report["traces"][t][f"best_static_by_{metric}"]
                if s is None:
                    continue
                ax.bar(i + (j - 1.5) * width, s[metric] or 0.0, width, color=colors[j],
                       label=name.split(" (")[0] if i == 0 else None)
                ax.plot(i + (j - 1.5) * width, s["peak_concurrent"], "k_", ms=12, label="peak" if i == j == 0 else None)
            ratio = report["traces"][t][f"ratio_{metric}"]["unified/best_static"]
            ax.annotate(f"unified / best static = {_x(ratio)}x", (i, 0), xytext=(0, -28), textcoords="offset points",
                        ha="center", fontsize=8)
        ax.set_xticks(range(len(traces)), traces)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("requests")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{report['conditions']['geometry']}, {budget / GIB:.0f} GiB budget", fontsize=10)
    fig.tight_layout()
    cmp_path = os.path.join(plots_dir, "capacity_comparison.png")
    fig.savefig(cmp_path, dpi=120)
    plt.close(fig)
    return [occ, cmp_path]


def main(argv=None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    hybrid = sorted(n for n in GEOMETRIES if all(x is not None for x in geometry(n)))
    p.add_argument("--geometry", default="kimi-linear-48b", choices=hybrid,
                   help="a hybrid geometry (KV and state; default kimi-linear-48b)")
    p.add_argument("--budget-gib", type=float, default=None, help="arena budget (default 40; 4 with --quick)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--tokens-per-tick", type=int, default=16)
    p.add_argument("--reserve", type=float, default=0.01, help="admission keeps this fraction of the growing pool free")
    p.add_argument("--seed", type=int, default=0, help="trace seed, >= 0")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--quick", action="store_true", help="tiny traces (a smoke run of a few seconds)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/capacity_<date>.json; "
                                               "with --quick, in a temporary folder)")
    p.add_argument("--plots", default=None, help="folder of the PNGs (default benchmarks/plots, the recorded "
                                                 "ones; with --quick, a temporary folder)")
    args = p.parse_args(argv)
    if args.budget_gib is None:
        args.budget_gib = 4.0 if args.quick else 40.0
    for name, ok in (("--reserve must be in [0, 1)", 0 <= args.reserve < 1),
                     ("--budget-gib must be positive and finite", 0 < args.budget_gib < float("inf")),
                     ("--tokens-per-tick must be >= 1", args.tokens_per_tick >= 1),
                     ("--page-size must be >= 1", args.page_size >= 1),
                     ("--seed must be >= 0", args.seed >= 0),
                     ("--jobs must be >= 1", args.jobs >= 1)):
        if not ok:
            print(f"bench_capacity: {name}; got --reserve {args.reserve} --budget-gib {args.budget_gib} "
                  f"--tokens-per-tick {args.tokens_per_tick} --page-size {args.page_size} --seed {args.seed} "
                  f"--jobs {args.jobs}", file=sys.stderr)
            return 2
    kv, state = geometry(args.geometry)
    budget = int(args.budget_gib * GIB)
    try:  # the budget must hold the unified arena's minimum (sink, tail pad, one page, one slot)
        UnifiedSystem(kv, state, budget, args.page_size)
    except GeometryError as e:
        print(f"bench_capacity: --budget-gib {args.budget_gib} with --page-size {args.page_size}: {e}", file=sys.stderr)
        return 2
    buildable = []
    for f in QUICK_GRID if args.quick else COARSE_GRID:  # and at least one static split of the grid
        try:
            StaticSplitSystem(kv, state, budget, f, args.page_size)
            buildable.append(f)
        except GeometryError:
            pass
    if not buildable:
        print(f"bench_capacity: --budget-gib {args.budget_gib} cannot hold any static split of the grid (each "
              "pool below its minimum: a sink, a tail pad and one page or slot); give a larger budget",
              file=sys.stderr)
        return 2
    if args.quick:  # a smoke run never overwrites the results and plots of record
        scratch = os.path.join(tempfile.gettempdir(), "unimem_capacity_quick")
        args.out = args.out or os.path.join(scratch, "capacity_quick.json")
        args.plots = args.plots or scratch
    args.plots = args.plots or os.path.join(here, "plots")
    start = time.perf_counter()
    report = run(args)
    paths = plot(report, args.plots)
    report.pop("_timelines")
    report["wall_s"] = round(time.perf_counter() - start, 1)
    report["plots"] = [os.path.relpath(x, os.path.dirname(here)) for x in paths]
    out = args.out or os.path.join(here, "results", f"capacity_{report['date']}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(format_table(report))
    print(f"\nwrote {out} and {', '.join(paths)} in {report['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
