"""End-to-end generation speed, side by side in one process: stock transformers vs unimem-compile.

Systems, each on a fresh model with the same seeded random weights (bf16 on CUDA):

* ``eager``  (a): stock ``generate()``, eager, its default cache (DynamicCache);
* ``static`` (b): stock ``generate(cache_implementation="static")``; on CUDA transformers then compiles the
  decode step itself (``torch.compile(model.__call__, mode="reduce-overhead")``: Inductor + CUDA graphs; the
  prefill stays eager). On the CPU it is made to compile with ``CompileConfig(backend="eager")``;
* ``unimem`` (c): ``unimem_compile.compile(model, cudagraphs=True, passes=True)`` with the pool sized for the
  batch (``memory_budget=None``: every row's ``prompt + new`` tokens and its state), then ``generate()``;
* ``unimem_fp8`` (d), with ``--kv-dtype fp8_e4m3`` (or ``fp8_e4m3fnuz``): (c) with ``kv_dtype=`` that fp8
  format (scaled fp8 rows, 656 instead of 1152 bytes per token and MLA layer; the pool is sized for them).
  ``--kv-dtype`` runs (c) and (d) side by side at batch 32, prompt 4096 unless ``--systems`` / ``--configs``
  say otherwise; its bundle is the run of record ``generate_fp8_<date>.json`` (docs/design.md section 8:
  ``generate_<date>.json`` holds bf16 runs only), with the ratios (d)/(c) of decode tokens/s, prefill time
  and peak memory.

Models: ``kimi-linear-48b-4l`` (the real Kimi-Linear-48B per-layer geometry, 3 KDA + 1 MLA, 8-expert MoE)
at batch 1, 8, 32 and prompt 512, 4096, plus ``kimi-linear-48b-8l`` (KDA, KDA, KDA, MLA x 2) at batch 32,
prompt 4096. Random prompt ids, no padding; 64 new tokens, no early stop (``min_new_tokens``), greedy.

Measured per system after one untimed warm-up generate (which compiles): every generate step is
timestamped by a logits processor (CUDA events: nothing extra syncs), so prefill = start to the first
step's logits and decode = first to last step's logits (``new - 1`` steps); the best of ``--repeats`` runs.
Decode tokens/s = batch x (new - 1) / decode time (PERF.md). Peak memory = ``torch.cuda.max_memory_allocated``
over the timed runs (reset after the warm-up; models, caches and compiled graphs are freed between
systems). Achieved bandwidth = ``demo.decode_step_bytes`` (every weight once, the latent KV of the mean
context, each state read and written) / the mean decode step time, beside the device copy bandwidth
measured in the same run. Ratios: (c)/(a) and (c)/(b) of decode tokens/s, prefill time and peak memory.

One JSON per configuration in ``--out``, rewritten after every system, so a run that hits a time limit
resumes where it stopped (systems already recorded are skipped; delete a file to redo it); ``--bundle``
also writes them all into one file, and ``--resume-from`` seeds ``--out`` from such a file (a fresh
machine). ``--deadline-s`` stops cleanly before a system that its running estimate says would not
finish in time. Configurations run most important first; ``--configs`` filters them by glob. A compact
table of everything in ``--out`` ends the run.

GPU:   source benchmarks/device_env.sh && python3 -P benchmarks/bench_generate.py --out /tmp/gen --deadline-s 470 \
           --bundle "$OUT/generate.json" [--resume-from benchmarks/results/generate_<date>.json]
fp8:   python3 -P benchmarks/bench_generate.py --kv-dtype fp8_e4m3 --out /tmp/gen_fp8 --bundle "$OUT/generate_fp8.json"
CPU:   python benchmarks/bench_generate.py --device cpu --smoke --out /tmp/gen      (tiny model, ~30 s)
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import gc
import importlib.util
import inspect
import json
import os
import platform
import subprocess
import sys
import time

import torch

from unimem_compile.demo import StepClock

SYSTEMS = ("eager", "static", "unimem")
#: (c) with fp8 KV (``--kv-dtype``); not one of SYSTEMS: bf16 bundles keep the three of docs/design.md section 8
FP8_SYSTEM = "unimem_fp8"
LABELS = {"eager": "(a) eager", "static": "(b) static+compile", "unimem": "(c) unimem",
          FP8_SYSTEM: "(d) unimem fp8 KV"}
#: the configuration ``--kv-dtype`` runs by default (the issue's: batch 32, prompt 4096)
FP8_CONFIGS = ["kimi-linear-48b-4l_b32_p4096"]


@dataclasses.dataclass(frozen=True)
class Config:
    model: str
    batch: int
    prompt: int

    @property
    def name(self) -> str:
        return f"{self.model}_b{self.batch}_p{self.prompt}"


#: most important first: batch 32 at both prompts, the 8-layer run, then smaller batches
CONFIGS = [
    Config("kimi-linear-48b-4l", 32, 512),
    Config("kimi-linear-48b-4l", 32, 4096),
    Config("kimi-linear-48b-8l", 32, 4096),
    Config("kimi-linear-48b-4l", 8, 512),
    Config("kimi-linear-48b-4l", 8, 4096),
    Config("kimi-linear-48b-4l", 1, 512),
    Config("kimi-linear-48b-4l", 1, 4096),
]
SMOKE_CONFIGS = [Config("kimi-linear-tiny", 2, 24), Config("kimi-linear-tiny", 1, 16)]

#: seconds a system is assumed to take before one of its kind has run (cold compile caches, first-call
#: autotuning); afterwards the longest measured one of its kind, x1.25
# seconds per system before one has run: measured on an H200 on 2026-11-29 at kimi-linear-48b-4l, batch 32,
# prompt 512 (eager 11 s, static 23 s; unimem's compile 40 s in the demo), with headroom
PRIOR_S = {"cuda": {"eager": 20.0, "static": 45.0, "unimem": 80.0, FP8_SYSTEM: 80.0},
           "cpu": {"eager": 5.0, "static": 20.0, "unimem": 20.0, FP8_SYSTEM: 20.0}}
#: flash-linear-attention autotunes its KDA kernels on their first call (about 90 s on an H200)
FLA_AUTOTUNE_S = 90.0


# ---------------------------------------------------------------------------------------------- environment
def fla_info() -> dict:
    """Whether flash-linear-attention imports, its version, and whether transformers' Kimi-Linear bound its
    KDA kernels (transformers picks them at import time)."""
    info = {"importable": False, "version": None, "bound_by_transformers": None}
    if importlib.util.find_spec("fla") is not None:
        try:
            import fla

            info["importable"], info["version"] = True, getattr(fla, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
            info["error"] = f"{type(e).__name__}: {e}"
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as mkl

        impl = inspect.getclosurevars(mkl.chunk_kimi_delta_attention).nonlocals.get("implementation")
        info["bound_by_transformers"] = bool(impl is not None and getattr(impl, "__module__", "").startswith("fla"))
    except Exception:  # noqa: BLE001 - another transformers layout: unknown, not fatal
        pass
    return info


def environment(device: torch.device) -> dict:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": str(device), "fla": fla_info()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu"] = platform.processor() or platform.machine()
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        env["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=here, capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git"] = None
    return env


def copy_bandwidth_gbs(device: torch.device) -> float | None:
    """Device-to-device copy of 1 GiB counting read + write (GB/s, median of 10), the ceiling the achieved
    bandwidth is read against; None on the CPU."""
    if device.type != "cuda":
        return None
    n = 1 << 30
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / sorted(times[2:])[len(times[2:]) // 2] / 1e9


# ---------------------------------------------------------------------------------------------- timing
def timed_generate(model, ids, kwargs: dict, device: torch.device) -> tuple[torch.Tensor, float, float, int]:
    """One generate() with a StepClock: ``(output ids, prefill s, decode s, decode steps)``."""
    clock = StepClock(device)
    clock.mark()
    with torch.no_grad():
        out = model.generate(ids, logits_processor=[clock], **kwargs)
    steps = len(clock.marks) - 2  # the start mark and the prefill step's logits
    return out, clock.elapsed(0, 1), clock.elapsed(1, len(clock.marks) - 1), steps


def _free(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        try:
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()
        except ImportError:
            pass
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- one system
def run_system(system: str, cfg: Config, args, device: torch.device, dtype: torch.dtype,
               reference=None) -> tuple[dict, torch.Tensor]:
    """Build the model, warm ``system`` up, time ``args.repeats`` generates; returns ``(its JSON record, the
    last output ids)``.

    ``reference``: output ids of the eager system for the same inputs (the record then gives the fraction
    of new tokens equal to it; bf16 greedy decoding may diverge after a near-tie, so this is a sanity
    figure, not a parity test).
    """
    import unimem_compile
    from unimem_compile.demo import decode_step_bytes
    from unimem_compile.hf.adapters import adapter_for
    from unimem_compile.hf.models import build_model

    _free(device)
    cuda = device.type == "cuda"
    model = build_model(cfg.model, dtype=dtype, device=device, seed=args.seed)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    adapter = adapter_for(model)
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(3, model.config.vocab_size, (cfg.batch, cfg.prompt), generator=gen).to(device)
    new = args.new_tokens
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": new, "min_new_tokens": new,
              "do_sample": False}
    record: dict = {"system": system}
    if system == "static":
        kwargs["cache_implementation"] = "static"
        if not cuda:  # transformers compiles only on accelerators unless told to
            from transformers import CompileConfig

            config = CompileConfig(backend="eager", mode=None)
            config._compile_all_devices = True
            kwargs["compile_config"] = config
        record["compile"] = "transformers auto-compile of the decode step (" + (
            "inductor, mode=reduce-overhead: CUDA graphs)" if cuda else "backend=eager on the CPU)")
    elif system in ("unimem", FP8_SYSTEM):
        deferred = {"auto": None, "on": True, "off": False}[args.deferred_stop] if cuda else None
        kv_dtype = args.kv_dtype if system == FP8_SYSTEM else None
        unimem_compile.compile(model, max_batch_size=cfg.batch, max_seq_len=cfg.prompt + new, memory_budget=None,
                               backend=args.backend, cudagraphs=cuda, passes=True, deferred_stop_check=deferred,
                               kv_dtype=kv_dtype)
        adapter = model.unimem.adapter  # its KV spec has the rows' dtype: the step bytes count fp8 rows
        record["compile"] = (f"unimem_compile.compile(backend={args.backend!r}, cudagraphs={cuda}, passes=True, "
                             f"deferred_stop_check={deferred}, kv_dtype={kv_dtype!r})")
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, **kwargs)  # warm-up: compiles, records CUDA graphs, autotunes
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    record["warmup_s"] = time.perf_counter() - t0
    runs = [timed_generate(model, ids, kwargs, device) for _ in range(args.repeats)]
    out = runs[-1][0]
    prefill = min(r[1] for r in runs)
    decode = min(r[2] for r in runs)
    steps = runs[-1][3]
    step_bytes = decode_step_bytes(model, adapter, cfg.batch, cfg.prompt + new / 2)
    record.update({
        "prefill_ms": prefill * 1e3,
        "decode_ms": decode * 1e3,
        "decode_steps": steps,
        "decode_tokens_per_s": cfg.batch * steps / decode if decode > 0 else None,
        "ms_per_step": decode * 1e3 / steps if steps else None,
        "runs": [{"prefill_ms": r[1] * 1e3, "decode_ms": r[2] * 1e3} for r in runs],
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "weight_bytes": weight_bytes,
        "step_bytes": step_bytes,
        "achieved_bandwidth_gbs": step_bytes / (decode / steps) / 1e9 if steps and decode > 0 else None,
        "new_tokens_generated": int(out.shape[1] - cfg.prompt),
    })
    if reference is not None:
        record["new_tokens_equal_to_eager"] = float((out[:, cfg.prompt:] == reference[:, cfg.prompt:]).float().mean())
    if system in ("unimem", FP8_SYSTEM):
        record["pool"] = model.unimem.stats()
        record["rewrites"] = model.unimem.rewrites
        record["kv_dtype"] = str(adapter.kv_spec.dtype).replace("torch.", "") if adapter.kv_spec else None
    del model, runs
    _free(device)
    return record, out


# ---------------------------------------------------------------------------------------------- driver
def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _save(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def ratios(systems: dict) -> dict:
    """(c)/(a), (c)/(b) and (d)/(c) of decode tokens/s, prefill time and peak memory, where both are recorded."""
    out = {}
    for mine, others in (("unimem", ("eager", "static")), (FP8_SYSTEM, ("unimem",))):
        c = systems.get(mine, {})
        for other in others:
            o = systems.get(other, {})
            for key in ("decode_tokens_per_s", "prefill_ms", "peak_memory_bytes"):
                if c.get(key) and o.get(key):
                    out[f"{key}_{mine}/{other}"] = c[key] / o[key]
    return out


def run(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    start = time.perf_counter()
    configs = SMOKE_CONFIGS if args.smoke else CONFIGS
    patterns = args.configs.split(",") if args.configs else (FP8_CONFIGS if args.kv_dtype and not args.smoke else None)
    if patterns:
        configs = [c for c in configs if any(fnmatch.fnmatch(c.name, p) for p in patterns)]
    systems = [s for s in SYSTEMS + (FP8_SYSTEM,) if s in args.systems.split(",")]
    expected = ("unimem", FP8_SYSTEM) if args.kv_dtype else SYSTEMS
    if args.resume_from:
        seed_from_bundle(args.resume_from, args.out)
    env = environment(device)
    log(f"environment: {json.dumps(env)}")
    todo = []
    conditions = run_conditions(args)
    for cfg in configs:
        rec = _load(os.path.join(args.out, cfg.name + ".json")) or {}
        if rec.get("systems"):
            # resuming adds systems to a record: only under the conditions its systems were measured in
            differ = {k: (rec.get(k), v) for k, v in conditions.items() if k in rec and rec[k] != v}
            if differ:
                what = ", ".join(f"{k} {a!r} there, {b!r} now" for k, (a, b) in differ.items())
                log(f"{cfg.name}: recorded under other conditions ({what}); use another --out or the same settings")
                return 2
        missing = [s for s in systems if s not in rec.get("systems", {})]
        if missing:
            todo.append((cfg, missing))
        else:
            log(f"{cfg.name}: recorded already, skipped")
    ceiling = copy_bandwidth_gbs(device) if todo else None
    observed: dict[str, float] = {}
    cuda_fla = device.type == "cuda" and bool(env["fla"]["bound_by_transformers"])
    stopped = None
    for cfg, missing in todo:
        path = os.path.join(args.out, cfg.name + ".json")
        rec = _load(path) or {}
        rec.update({"config": dataclasses.asdict(cfg), **conditions, "repeats": args.repeats, "environment": env,
                    "copy_bandwidth_gbs": ceiling, "command": "python " + " ".join(sys.argv)})
        rec.setdefault("systems", {})
        reference = None
        for system in missing:
            elapsed = time.perf_counter() - start
            estimate = 1.25 * observed[system] if system in observed else PRIOR_S[device.type][system]
            if system == "eager" and system not in observed and cuda_fla:
                estimate += FLA_AUTOTUNE_S
            if args.deadline_s is not None and elapsed + estimate > args.deadline_s:
                stopped = (f"deadline: {elapsed:.0f} s spent of {args.deadline_s:.0f} s; {LABELS[system]} of "
                           f"{cfg.name} is estimated at {estimate:.0f} s: stopping here")
                break
            log(f"{cfg.name}: {LABELS[system]} ...")
            t0 = time.perf_counter()
            try:
                result, out = run_system(system, cfg, args, device, dtype, reference)
                if system == "eager":
                    reference = out
            except Exception as e:  # noqa: BLE001 - record the failure, free memory, keep going
                result = {"system": system, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
                _free(device)
            took = time.perf_counter() - t0
            result["wall_s"] = took
            observed[system] = max(observed.get(system, 0.0), took)
            rec["systems"][system] = result
            rec["ratios"] = ratios(rec["systems"])
            rec["complete"] = all(s in rec["systems"] for s in expected)
            _save(path, rec)
            log(f"{cfg.name}: {LABELS[system]} done in {took:.1f} s"
                + (f" ERROR {result['error'][:200]}" if "error" in result else
                   f": prefill {_num(result.get('prefill_ms'), '.1f', 0)} ms, decode "
                   f"{_num(result.get('decode_tokens_per_s'), '.1f', 0)} tok/s"))
        if stopped:
            break
    if stopped:
        log(stopped)
    if ceiling:
        log(f"device copy bandwidth (read + write) {ceiling:.0f} GB/s")
    print(format_table(args.out, configs))
    if args.bundle:
        write_bundle(args.out, configs, args.bundle)
        log(f"wrote {args.bundle}")
    log(f"total {time.perf_counter() - start:.0f} s")
    return 0


def run_conditions(args) -> dict:
    """What a record's measurements depend on beyond its configuration: a resumed run must match them."""
    return {"new_tokens": args.new_tokens, "dtype": args.dtype, "seed": args.seed, "backend": args.backend,
            "deferred_stop": args.deferred_stop, "kv_dtype": args.kv_dtype}


def _num(value, fmt: str, width: int) -> str:
    return f"{value:>{width}{fmt}}" if isinstance(value, (int, float)) else f"{'n/a':>{width}}"


def write_bundle(out_dir: str, configs: list[Config], path: str) -> None:
    """One JSON ``{configuration name: record}`` of every recorded configuration of ``configs``."""
    bundle = {c.name: rec for c in configs if (rec := _load(os.path.join(out_dir, c.name + ".json")))}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _save(path, bundle)


def seed_from_bundle(path: str, out_dir: str) -> None:
    """Write the records of a bundle (see :func:`write_bundle`) into ``out_dir`` where that folder has no
    file of that configuration yet, so a run on a fresh machine resumes a previous one."""
    bundle = _load(path) or {}
    for name, rec in bundle.items():
        target = os.path.join(out_dir, name + ".json")
        if not os.path.exists(target):
            _save(target, rec)


def format_table(out_dir: str, configs: list[Config]) -> str:
    """The compact table of every recorded configuration of ``configs`` in ``out_dir``."""
    head = (f"{'config':<30}{'system':<20}{'prefill ms':>11}{'decode tok/s':>13}{'ms/step':>9}{'peak GiB':>9}"
            f"{'GB/s':>8}{'c/a':>7}{'c/b':>7}")
    lines = [head, "-" * len(head)]
    for cfg in configs:
        rec = _load(os.path.join(out_dir, cfg.name + ".json"))
        if not rec:
            continue
        r = rec.get("ratios", {})
        for system in SYSTEMS + (FP8_SYSTEM,):
            s = rec["systems"].get(system)
            if s is None:
                continue
            if "error" in s:
                lines.append(f"{cfg.name:<30}{LABELS[system]:<20} ERROR {s['error'][:60]}")
                continue
            peak = s.get("peak_memory_bytes")
            tail = ""
            if system == "unimem":
                tail = "".join(f"{r[k]:>7.2f}" if k in r else f"{'-':>7}"
                               for k in ("decode_tokens_per_s_unimem/eager", "decode_tokens_per_s_unimem/static"))
            elif system == FP8_SYSTEM:
                key = f"decode_tokens_per_s_{FP8_SYSTEM}/unimem"
                tail = f"   d/c {r[key]:.2f}" if key in r else ""
            lines.append(f"{cfg.name:<30}{LABELS[system]:<20}{_num(s.get('prefill_ms'), '.1f', 11)}"
                         f"{_num(s.get('decode_tokens_per_s'), '.1f', 13)}{_num(s.get('ms_per_step'), '.2f', 9)}"
                         f"{_num(peak / 2**30 if peak else None, '.2f', 9)}"
                         f"{_num(s.get('achieved_bandwidth_gbs'), '.1f', 8)}{tail}")
    return "\n".join(lines)


def log(msg: str) -> None:
    print(f"[bench_generate {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder of the per-configuration JSONs (resumed if present)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes (a CPU check of the whole path)")
    p.add_argument("--configs", default=None, help="comma-separated globs over names like kimi-linear-48b-4l_b32_p512")
    p.add_argument("--systems", default=None,
                   help="subset of eager,static,unimem (default all three) and, with --kv-dtype, unimem_fp8 "
                        "(default with --kv-dtype: unimem,unimem_fp8)")
    p.add_argument("--kv-dtype", default=None, choices=["fp8_e4m3", "fp8_e4m3fn", "fp8_e4m3fnuz"],
                   help="run (d) unimem_fp8 with this KV dtype beside (c); default configuration "
                        f"{FP8_CONFIGS[0]} (the bundle is generate_fp8_<date>.json)")
    p.add_argument("--deadline-s", type=float, default=None, help="stop before a system that would end past this")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (4 with --smoke)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per system, best kept (default 2; 1 smoke)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"], help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--backend", default=None, help="unimem's inner backend (default inductor; eager with --smoke)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deferred-stop", default="auto", choices=["auto", "on", "off"],
                   help="(c)'s deferred_stop_check: None (auto, the default), True or False")
    p.add_argument("--bundle", default=None, help="also write every recorded configuration into this one JSON")
    p.add_argument("--resume-from", default=None, help="a bundle of an earlier run: its records are kept")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_generate: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if args.new_tokens is not None and args.new_tokens < 2:
        print(f"bench_generate: --new-tokens must be >= 2 (decode speed needs a decode step), got {args.new_tokens}",
              file=sys.stderr)
        return 2
    if args.repeats is not None and args.repeats < 1:
        print(f"bench_generate: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    if args.systems is None:
        args.systems = f"unimem,{FP8_SYSTEM}" if args.kv_dtype else ",".join(SYSTEMS)
    unknown = sorted(set(args.systems.split(",")) - set(SYSTEMS) - ({FP8_SYSTEM} if args.kv_dtype else set()))
    if unknown:
        choices = list(SYSTEMS) + ([FP8_SYSTEM] if args.kv_dtype else [])
        hint = f" ({FP8_SYSTEM} needs --kv-dtype)" if FP8_SYSTEM in unknown else ""
        print(f"bench_generate: unknown --systems {unknown}; choose from {choices}{hint}", file=sys.stderr)
        return 2
    args.new_tokens = args.new_tokens if args.new_tokens is not None else (4 if args.smoke else 64)
    args.repeats = args.repeats if args.repeats is not None else (1 if args.smoke else 2)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.backend = args.backend or ("eager" if args.smoke else "inductor")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
