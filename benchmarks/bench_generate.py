"""End-to-end generation speed, side by side in one process: stock transformers vs unimem-compile.

Systems, each on a model of its own with the same seeded random weights (bf16 on CUDA):

* ``eager``  (a): stock ``generate()``, eager, its default cache (DynamicCache);
* ``static`` (b): stock ``generate(cache_implementation="static")``; on CUDA transformers then compiles the
  decode step itself (``torch.compile(model.__call__, mode="reduce-overhead")``: Inductor + CUDA graphs; the
  prefill stays eager). On the CPU it is made to compile with ``CompileConfig(backend="eager")``;
* ``unimem`` (c): ``unimem_compile.compile(model, passes=True)`` (``cudagraphs`` at its default: on for CUDA,
  so the decode runner replays one captured graph per step) with the pool sized for the batch
  (``memory_budget=None``: every row's ``prompt + new`` tokens and its state), then ``generate()``;
* ``handloop`` (d): no generate(): the loop a user writes in thirty lines (gpt-fast style; PERF.md's
  strongest decode anchor): stock transformers with its ``StaticCache``, the prefill eager, then
  forward(one token) + argmax compiled with Inductor and captured by hand in one ``torch.cuda.CUDAGraph``,
  replayed once per step (on the CPU the compiled step is called, uncaptured);
* ``unimem_fp8`` (e), with ``--kv-dtype fp8_e4m3`` (or ``fp8_e4m3fnuz``): (c) with ``kv_dtype=`` that fp8
  format (scaled fp8 rows, 656 instead of 1152 bytes per token and MLA layer; the pool is sized for them).
  ``--kv-dtype`` runs (c) and (e) side by side at batch 32, prompt 4096 unless ``--systems`` / ``--configs``
  say otherwise; its bundle is the run of record ``generate_fp8_<date>.json`` (docs/design.md section 8:
  ``generate_<date>.json`` holds bf16 runs only), with the ratios (e)/(c) of decode tokens/s, prefill time
  and peak memory.

Models: ``kimi-linear-48b-4l`` (the real Kimi-Linear-48B per-layer geometry, 3 KDA + 1 MLA, 8-expert MoE)
at batch 1, 8, 32 and prompt 512, 4096, plus ``kimi-linear-48b-8l`` (KDA, KDA, KDA, MLA x 2) at batch 32,
prompt 4096. Random prompt ids, no padding; 64 new tokens, no early stop (``min_new_tokens``), greedy.

Measured per configuration: every system is built and warmed up (one untimed generate, which compiles and
captures), then ``--repeats`` rounds each time every system once, the systems alternating (the order
rotates by one each round), so slow drifts of the machine hit every system alike. Clocks: (a) and (b) a
logits processor that records a CUDA event at every step (nothing extra syncs): prefill = start to the
first step's logits, decode = first to last step's logits (``new - 1`` steps); (c) the decode runner's own
clock (``model.unimem.timed_decode()``: events at the end of the prefill and after every block of replayed
steps; a logits processor would send the call to transformers' loop), (e) likewise; (d) events after its
first token and after its last replay. Per system the median over the rounds; each ratio (of decode
tokens/s, prefill time, peak memory) is the median of the per-round ratios. Decode tokens/s = batch x
(new - 1) / decode time (PERF.md). Peak memory = the bytes the system holds once warm (weights, pool or cache, graphs' live
tensors: ``memory_allocated`` before and after its build) + the most its timed runs add
(``max_memory_allocated`` over a run minus the allocated bytes at its start). Achieved bandwidth =
``demo.decode_step_bytes`` (every weight once, the latent KV of the mean context, each state read and
written) / the median decode step time, beside the device copy bandwidth measured in the same run.
``--profile`` adds, for (c) (and (e)) on CUDA, one generate under ``torch.profiler``: the GPU kernel time of a decode
step (the kernels its graph replays launch) beside its wall time (``profile``: ``wall_ms_per_step``,
``kernel_ms_per_step``, ``busy_ms_per_step`` (kernels' union), ``wall_over_kernel``).

One JSON per configuration in ``--out``, rewritten after the configuration, so a run that hits a time limit
resumes where it stopped (configurations recorded already are skipped; delete a file to redo it);
``--bundle`` also writes them all into one file, and ``--resume-from`` seeds ``--out`` from such a file (a
fresh machine). ``--deadline-s`` stops cleanly before a configuration that its running estimate says
would not finish in time. Configurations run most important first; ``--configs`` filters them by glob. A
compact table of everything in ``--out`` ends the run.

GPU:   source benchmarks/device_env.sh && python3 -P benchmarks/bench_generate.py --out /tmp/gen --deadline-s 470 \
           --bundle "$OUT/generate.json" [--resume-from benchmarks/results/generate_<date>.json] [--profile]
fp8:   python3 -P benchmarks/bench_generate.py --kv-dtype fp8_e4m3 --out /tmp/gen_fp8 --bundle "$OUT/generate_fp8.json"
CPU:   python benchmarks/bench_generate.py --device cpu --smoke --out /tmp/gen      (tiny model, ~1 min)
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
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from unimem_compile.demo import StepClock

SYSTEMS = ("eager", "static", "unimem", "handloop")
#: (c) with fp8 KV (``--kv-dtype``); not one of SYSTEMS: bf16 bundles keep the systems of docs/design.md section 8
FP8_SYSTEM = "unimem_fp8"
LABELS = {"eager": "(a) eager", "static": "(b) static+compile", "unimem": "(c) unimem", "handloop": "(d) hand loop",
          FP8_SYSTEM: "(e) unimem fp8 KV"}
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
    Config("kimi-linear-48b-4l", 1, 512),
    Config("kimi-linear-48b-4l", 8, 512),
    Config("kimi-linear-48b-4l", 8, 4096),
    Config("kimi-linear-48b-4l", 1, 4096),
]
SMOKE_CONFIGS = [Config("kimi-linear-tiny", 2, 24), Config("kimi-linear-tiny", 1, 16)]

#: seconds a system's build, warm-up and one timed run are assumed to take before one of its kind has run
#: (cold compile caches, first-call autotuning); afterwards the longest measured one of its kind, x1.25.
#: Measured on an H200 on 2026-11-29 at kimi-linear-48b-4l, batch 32, prompt 512 (eager 11 s, static 23 s;
#: unimem's compile 40 s in the demo), with headroom; the runner's per-bucket step compile and the hand loop's
#: compile are estimates (not measured yet)
PRIOR_S = {"cuda": {"eager": 20.0, "static": 45.0, "unimem": 90.0, "handloop": 45.0, FP8_SYSTEM: 90.0},
           "cpu": {"eager": 5.0, "static": 20.0, "unimem": 30.0, "handloop": 10.0, FP8_SYSTEM: 30.0}}
#: seconds per timed generate beyond the first, per system (the rounds after the warm-up)
ROUND_S = {"cuda": 2.0, "cpu": 2.0}
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
def _event(device: torch.device):
    """A mark now: a CUDA event recorded on the current stream, or ``perf_counter`` on the CPU."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _seconds(a, b) -> float:
    if isinstance(a, float):
        return b - a
    b.synchronize()
    return a.elapsed_time(b) * 1e-3


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


class HandLoop:
    """The hand-rolled decode loop over stock transformers (system (d)): thirty lines a user writes.

    A ``StaticCache`` for ``prompt + new`` tokens; the prefill an eager forward; then one compiled function
    (forward of one token per row with the static cache, argmax, store the token) captured in one
    ``torch.cuda.CUDAGraph`` after two warm-up calls, replayed ``new - 1`` times. The static cache's layers
    advance their own lengths on the device, so a replay writes the next position; :meth:`generate` resets
    the cache before its prefill. Greedy, no padding, no EOS (what the benchmark runs).
    """

    def __init__(self, model, batch: int, prompt: int, new: int, device: torch.device, backend: str):
        from transformers import StaticCache

        self.model, self.new, self.device = model, new, device
        self.cache = StaticCache(config=model.config, max_cache_len=prompt + new)
        params = inspect.signature(model.forward).parameters
        self.key = "cache" if "cache" in params else "past_key_values"  # transformers 5.24 / 5.17
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.out = torch.zeros(batch, new, dtype=torch.long, device=device)
        self.index = torch.zeros(1, dtype=torch.long, device=device)

        def step():
            logits = model(input_ids=self.token, position_ids=self.position, use_cache=True, logits_to_keep=1,
                           **{self.key: self.cache}).logits
            token = logits[:, -1].argmax(-1)
            self.token.copy_(token[:, None])
            self.position.add_(1)
            self.out.index_copy_(1, self.index, token[:, None])
            self.index.add_(1)

        # graph breaks (transformers binds flash-linear-attention's kernels when it is installed) cost nothing
        # here: the capture records every kernel of the step whatever Dynamo made of it
        self.step = torch.compile(step, backend=backend)
        self.graph = None

    def _prefill(self, ids: torch.Tensor) -> None:
        self.cache.reset()
        logits = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.key: self.cache}).logits
        token = logits[:, -1].argmax(-1)
        self.token.copy_(token[:, None])
        self.position.fill_(ids.shape[1])
        self.out[:, 0] = token
        self.index.fill_(1)

    def warm_up(self, ids: torch.Tensor) -> None:
        with torch.no_grad():
            self._prefill(ids)
            if self.device.type != "cuda":
                self.step()
                return
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.step()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.step()
            torch.cuda.synchronize()

    def generate(self, ids: torch.Tensor) -> tuple[torch.Tensor, float, float, int]:
        """``(output ids, prefill s, decode s, decode steps)``."""
        start = _event(self.device)
        with torch.no_grad():
            self._prefill(ids)
            first = _event(self.device)
            for _ in range(self.new - 1):
                if self.graph is not None:
                    self.graph.replay()
                else:
                    self.step()
            last = _event(self.device)
        return torch.cat([ids, self.out], 1), _seconds(start, first), _seconds(first, last), self.new - 1


class Session:
    """One system on one configuration: its model built and warmed up, then timed runs on demand.

    ``resident_bytes``: what the system holds once warm (``memory_allocated`` after its build and warm-up
    minus before it; 0 on the CPU). Each :meth:`timed` run appends ``(prefill s, decode s, steps, transient
    peak bytes)`` to ``runs``.
    """

    def __init__(self, system: str, cfg: Config, args, device: torch.device, dtype: torch.dtype):
        import unimem_compile
        from unimem_compile.hf.adapters import adapter_for
        from unimem_compile.hf.models import build_model

        self.system, self.cfg, self.args, self.device = system, cfg, args, device
        cuda = device.type == "cuda"
        allocated = torch.cuda.memory_allocated(device) if cuda else 0
        t0 = time.perf_counter()
        self.model = model = build_model(cfg.model, dtype=dtype, device=device, seed=args.seed)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.adapter = adapter_for(model)
        gen = torch.Generator().manual_seed(args.seed + 1)
        self.ids = torch.randint(3, model.config.vocab_size, (cfg.batch, cfg.prompt), generator=gen).to(device)
        new = args.new_tokens
        self.kwargs = {"attention_mask": torch.ones_like(self.ids), "max_new_tokens": new, "min_new_tokens": new,
                       "do_sample": False}
        self.record: dict = {"system": system}
        self.hand = None
        if system == "static":
            self.kwargs["cache_implementation"] = "static"
            if not cuda:  # transformers compiles only on accelerators unless told to
                from transformers import CompileConfig

                config = CompileConfig(backend="eager", mode=None)
                config._compile_all_devices = True
                self.kwargs["compile_config"] = config
            self.record["compile"] = "transformers auto-compile of the decode step (" + (
                "inductor, mode=reduce-overhead: CUDA graphs)" if cuda else "backend=eager on the CPU)")
        elif system in ("unimem", FP8_SYSTEM):
            deferred = {"auto": None, "on": True, "off": False}[args.deferred_stop] if cuda else None
            fp8 = {"kv_dtype": args.kv_dtype} if system == FP8_SYSTEM else {}
            unimem_compile.compile(model, max_batch_size=cfg.batch, max_seq_len=cfg.prompt + new, memory_budget=None,
                                   backend=args.backend, passes=True, deferred_stop_check=deferred, **fp8)
            self.record["compile"] = (f"unimem_compile.compile(backend={args.backend!r}, cudagraphs=None (on for "
                                      f"CUDA), passes=True, deferred_stop_check={deferred}"
                                      + "".join(f", {k}={v!r}" for k, v in fp8.items()) + ")")
            if fp8:
                self.adapter = model.unimem.adapter  # its KV spec has the rows' dtype: the step bytes count fp8 rows
        elif system == "handloop":
            self.hand = HandLoop(model, cfg.batch, cfg.prompt, new, device,
                                 "inductor" if cuda else args.backend)
            self.record["compile"] = ("torch.compile(forward + argmax, backend=" + ("'inductor'" if cuda else
                                      repr(args.backend)) + ") over transformers' StaticCache" +
                                      (", captured in one torch.cuda.CUDAGraph" if cuda else ", uncaptured"))
        if self.hand is not None:
            self.hand.warm_up(self.ids)
        else:
            with torch.no_grad():
                model.generate(self.ids, **self.kwargs)  # warm-up: compiles, records CUDA graphs, autotunes
        if cuda:
            torch.cuda.synchronize(device)
        self.record["warmup_s"] = time.perf_counter() - t0
        self.resident_bytes = (torch.cuda.memory_allocated(device) - allocated) if cuda else 0
        self.runs: list[tuple[float, float, int, int]] = []
        self.out = None

    def timed(self) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.hand is not None:
            out, prefill, decode, steps = self.hand.generate(self.ids)
        elif self.system in ("unimem", FP8_SYSTEM):
            out, prefill, decode, steps = self._timed_unimem()
        else:
            clock = StepClock(self.device)
            clock.mark()
            with torch.no_grad():
                out = self.model.generate(self.ids, logits_processor=[clock], **self.kwargs)
            steps = len(clock.marks) - 2  # the start mark and the prefill step's logits
            prefill, decode = clock.elapsed(0, 1), clock.elapsed(1, len(clock.marks) - 1)
        transient = (torch.cuda.max_memory_allocated(self.device) - base) if cuda else 0
        self.runs.append((prefill, decode, steps, transient))
        self.out = out

    def _timed_unimem(self):
        start = _event(self.device)
        with self.model.unimem.timed_decode() as timing, torch.no_grad():
            out = self.model.generate(self.ids, **self.kwargs)
        return out, timing.seconds_since(start), timing.decode_seconds(), timing.decode_steps

    def finish(self, reference, ceiling) -> dict:
        """The system's JSON record (medians over its runs); ``reference``: the eager system's output ids for
        the same inputs (the record then gives the fraction of new tokens equal to it; bf16 greedy decoding
        may diverge after a near-tie, so this is a sanity figure, not a parity test)."""
        from unimem_compile.demo import decode_step_bytes

        cfg, new = self.cfg, self.args.new_tokens
        prefill = statistics.median(r[0] for r in self.runs)
        decode = statistics.median(r[1] for r in self.runs)
        steps = self.runs[-1][2]
        step_bytes = decode_step_bytes(self.model, self.adapter, cfg.batch, cfg.prompt + new / 2)
        record = dict(self.record)
        record.update({
            "prefill_ms": prefill * 1e3,
            "decode_ms": decode * 1e3,
            "decode_steps": steps,
            "decode_tokens_per_s": cfg.batch * steps / decode if decode > 0 else None,
            "ms_per_step": decode * 1e3 / steps if steps else None,
            "runs": [{"prefill_ms": r[0] * 1e3, "decode_ms": r[1] * 1e3} for r in self.runs],
            "peak_memory_bytes": (self.resident_bytes + max(r[3] for r in self.runs))
            if self.device.type == "cuda" else None,
            "weight_bytes": self.weight_bytes,
            "step_bytes": step_bytes,
            "achieved_bandwidth_gbs": step_bytes / (decode / steps) / 1e9 if steps and decode > 0 else None,
            "new_tokens_generated": int(self.out.shape[1] - cfg.prompt),
        })
        if ceiling and record["achieved_bandwidth_gbs"]:
            record["fraction_of_copy_bandwidth"] = record["achieved_bandwidth_gbs"] / ceiling
        if reference is not None:
            record["new_tokens_equal_to_eager"] = float(
                (self.out[:, cfg.prompt:] == reference[:, cfg.prompt:]).float().mean())
        if self.system in ("unimem", FP8_SYSTEM):
            record["pool"] = self.model.unimem.stats()
            record["rewrites"] = self.model.unimem.rewrites
            record["runner"] = self.model.unimem.runner_stats()
            if self.args.profile:
                record["profile"] = self.profile(record["ms_per_step"])
        if self.system == FP8_SYSTEM:
            spec = self.adapter.kv_spec
            record["kv_dtype"] = str(spec.dtype).replace("torch.", "") if spec else None
        return record

    def profile(self, wall_ms_per_step: float) -> dict:
        """One generate under torch.profiler: the GPU kernel time of a decode step (the kernels of the
        runner's graph replays) beside its wall time (the median of the timed runs)."""
        if self.device.type != "cuda":
            return {"skipped": "needs CUDA (the kernels of the captured steps)"}
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, torch.no_grad():
            self.model.generate(self.ids, **self.kwargs)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f).get("traceEvents", [])
        result = graph_kernel_time(events)
        if result["replays"]:
            result["wall_ms_per_step"] = wall_ms_per_step
            result["wall_over_kernel"] = wall_ms_per_step / result["kernel_ms_per_step"]
        return result

    def close(self) -> None:
        self.model = self.hand = self.out = None


def graph_kernel_time(events: list[dict]) -> dict:
    """Per CUDA-graph replay in a chrome trace (torch.profiler's ``export_chrome_trace`` events): the
    kernels that replays launched (matched by correlation id to ``cudaGraphLaunch`` runtime calls), their
    summed duration, their union on the GPU timeline (overlapping kernels counted once) and their count,
    each divided by the number of replays. Returns ``{"replays", "kernel_ms_per_step", "busy_ms_per_step",
    "kernels_per_step"}`` (None values without replays)."""
    launches = {e["args"]["correlation"] for e in events
                if e.get("cat") == "cuda_runtime" and str(e.get("name", "")).startswith("cudaGraphLaunch")
                and "correlation" in e.get("args", {})}
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
                     if e.get("cat") == "kernel" and e.get("args", {}).get("correlation") in launches)
    if not launches:
        return {"replays": 0, "kernel_ms_per_step": None, "busy_ms_per_step": None, "kernels_per_step": None}
    total = sum(b - a for a, b in kernels)
    busy, end = 0.0, float("-inf")
    for a, b in kernels:  # union of intervals, in microseconds
        if b > end:
            busy += b - max(a, end)
            end = b
    n = len(launches)
    return {"replays": n, "kernel_ms_per_step": total / n / 1e3, "busy_ms_per_step": busy / n / 1e3,
            "kernels_per_step": len(kernels) / n}


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


_RATIO_KEYS = ("decode_tokens_per_s", "prefill_ms", "peak_memory_bytes")


def ratios(systems: dict) -> dict:
    """(c)/(a), (c)/(b), (c)/(d) and (e)/(c) of decode tokens/s, prefill time and peak memory, where both
    are recorded: the median of the per-round ratios when both systems ran in the same rounds, else the
    ratio of their medians. ``_rounds`` lists which ratios are per-round medians."""
    out, rounds = {}, []
    for mine, others in (("unimem", ("eager", "static", "handloop")), (FP8_SYSTEM, ("unimem",))):
        c = systems.get(mine, {})
        for other in others:
            o = systems.get(other, {})
            for key in _RATIO_KEYS:
                if not (c.get(key) and o.get(key)):
                    continue
                name = f"{key}_{mine}/{other}"
                pairs = list(zip(c.get("runs", []), o.get("runs", [])))
                if key != "peak_memory_bytes" and c.get("session") is not None \
                        and c.get("session") == o.get("session") and pairs:
                    per_round = []
                    for rc, ro in pairs:
                        if key == "prefill_ms":
                            per_round.append(rc["prefill_ms"] / ro["prefill_ms"])
                        else:  # tokens/s: the inverse ratio of decode times (same steps and batch)
                            per_round.append(ro["decode_ms"] / rc["decode_ms"])
                    out[name] = statistics.median(per_round)
                    rounds.append(name)
                else:
                    out[name] = c[key] / o[key]
    out["_rounds"] = rounds
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
        elapsed = time.perf_counter() - start
        estimate = sum(1.25 * observed[s] if s in observed else PRIOR_S[device.type][s] for s in missing)
        estimate += (args.repeats - 1) * len(missing) * ROUND_S[device.type]
        if cuda_fla and not observed and any(s in missing for s in ("eager", "static", "handloop")):
            estimate += FLA_AUTOTUNE_S
        if args.deadline_s is not None and elapsed + estimate > args.deadline_s:
            stopped = (f"deadline: {elapsed:.0f} s spent of {args.deadline_s:.0f} s; {cfg.name} "
                       f"({', '.join(missing)}) is estimated at {estimate:.0f} s: stopping here")
            break
        path = os.path.join(args.out, cfg.name + ".json")
        rec = _load(path) or {}
        rec.update({"config": dataclasses.asdict(cfg), **conditions, "repeats": args.repeats, "environment": env,
                    "copy_bandwidth_gbs": ceiling, "command": "python " + " ".join(sys.argv)})
        rec.setdefault("systems", {})
        session_id = f"{time.time():.0f}-{os.getpid()}"
        sessions: dict[str, Session] = {}
        for system in missing:
            log(f"{cfg.name}: {LABELS[system]}: build and warm up ...")
            t0 = time.perf_counter()
            try:
                sessions[system] = Session(system, cfg, args, device, dtype)
            except Exception as e:  # noqa: BLE001 - record the failure, free memory, keep going
                rec["systems"][system] = {"system": system, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
                _free(device)
            observed[system] = max(observed.get(system, 0.0), time.perf_counter() - t0)
        live = list(sessions)
        for r in range(args.repeats):
            order = live[r % len(live):] + live[:r % len(live)] if live else []
            for system in order:
                if system not in sessions:
                    continue
                try:
                    sessions[system].timed()
                except Exception as e:  # noqa: BLE001 - this system is out of the remaining rounds
                    rec["systems"][system] = {"system": system, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
                    sessions.pop(system).close()
        reference = sessions["eager"].out if "eager" in sessions else None
        for system in live:
            if system not in sessions:
                continue
            try:
                result = sessions[system].finish(reference if system != "eager" else None, ceiling)
                result["session"] = session_id
            except Exception as e:  # noqa: BLE001
                result = {"system": system, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
            rec["systems"][system] = result
            log(f"{cfg.name}: {LABELS[system]}" + (f" ERROR {result['error'][:200]}" if "error" in result else
                f": prefill {_num(result.get('prefill_ms'), '.1f', 0)} ms, decode "
                f"{_num(result.get('decode_tokens_per_s'), '.1f', 0)} tok/s, "
                f"{_num(result.get('ms_per_step'), '.3f', 0)} ms/step"))
        for session in sessions.values():
            session.close()
        sessions.clear()
        _free(device)
        rec["ratios"] = ratios(rec["systems"])
        rec["complete"] = all(s in rec["systems"] for s in expected)
        _save(path, rec)
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
    """The compact table of every recorded configuration of ``configs`` in ``out_dir`` (ratios of decode
    tokens/s of (c) over (a), (b) and (d); of (e) over (c) on its own row)."""
    head = (f"{'config':<30}{'system':<20}{'prefill ms':>11}{'decode tok/s':>13}{'ms/step':>9}{'peak GiB':>9}"
            f"{'GB/s':>8}{'c/a':>7}{'c/b':>7}{'c/d':>7}")
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
                               for k in ("decode_tokens_per_s_unimem/eager", "decode_tokens_per_s_unimem/static",
                                         "decode_tokens_per_s_unimem/handloop"))
            elif system == FP8_SYSTEM:
                key = f"decode_tokens_per_s_{FP8_SYSTEM}/unimem"
                tail = f"   e/c {r[key]:.2f}" if key in r else ""
            lines.append(f"{cfg.name:<30}{LABELS[system]:<20}{_num(s.get('prefill_ms'), '.1f', 11)}"
                         f"{_num(s.get('decode_tokens_per_s'), '.1f', 13)}{_num(s.get('ms_per_step'), '.2f', 9)}"
                         f"{_num(peak / 2**30 if peak else None, '.2f', 9)}"
                         f"{_num(s.get('achieved_bandwidth_gbs'), '.1f', 8)}{tail}")
            prof = s.get("profile") or {}
            if prof.get("wall_over_kernel"):
                lines.append(f"{'':<30}{'  profile':<20} wall {prof['wall_ms_per_step']:.3f} ms/step, kernels "
                             f"{prof['kernel_ms_per_step']:.3f} (busy {prof['busy_ms_per_step']:.3f}), wall/kernel "
                             f"{prof['wall_over_kernel']:.2f}, {prof['kernels_per_step']:.0f} kernels/step")
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
                   help="subset of " + ",".join(SYSTEMS) + f" (default all) and, with --kv-dtype, {FP8_SYSTEM} "
                        f"(default with --kv-dtype: unimem,{FP8_SYSTEM})")
    p.add_argument("--kv-dtype", default=None, choices=["fp8_e4m3", "fp8_e4m3fn", "fp8_e4m3fnuz"],
                   help=f"run (e) {FP8_SYSTEM} with this KV dtype beside (c); default configuration "
                        f"{FP8_CONFIGS[0]} (the bundle is generate_fp8_<date>.json)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="stop before a configuration that would end past this")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (4 with --smoke)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds, the systems alternating; medians kept (default 3; 1 with --smoke)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"], help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--backend", default=None, help="unimem's inner backend (default inductor; eager with --smoke)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deferred-stop", default="auto", choices=["auto", "on", "off"],
                   help="(c)'s deferred_stop_check: None (auto, the default), True or False")
    p.add_argument("--bundle", default=None, help="also write every recorded configuration into this one JSON")
    p.add_argument("--resume-from", default=None, help="a bundle of an earlier run: its records are kept")
    p.add_argument("--profile", action="store_true",
                   help="(c) on CUDA: one more generate under torch.profiler: a step's kernel time vs its wall time")
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
    args.repeats = args.repeats if args.repeats is not None else (1 if args.smoke else 3)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.backend = args.backend or ("eager" if args.smoke else "inductor")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
