"""KDA decode and short-conv update on arena slots: effective bandwidth as a fraction of the device copy
bandwidth measured in the same run, side by side with flash-linear-attention's in-place pooled decode.

Setup: a 512-slot pool of Kimi-Linear KDA states (32 heads x 128 x 128 fp32 = 2 MiB, plus the layer's
[3*32*128, 4] bf16 conv section, so the slot pitch is 2 MiB + 96 KiB and every state is addressed by pitch);
each batch reads and updates B distinct random slots in place. Inputs bf16 (g fp32), random, never zeros.

Bytes counted (PERF.md): kda_decode = state read + state write (B*H*K*V*4 each) + q, k, v, g, beta, out;
causal_conv1d_update = conv state read + write + x + out + weight. Times are triton.testing.do_bench
medians (L2 flushed between reps), eagerly and replayed from a CUDA graph (no launch overhead).
fla column: ``fused_recurrent_kda_fwd`` with ``ssm_state_indices`` updating a contiguous [512, H, K, V] pool
in place (its public ``fused_recurrent_kda`` has no slot argument), skipped when ``fla`` does not import.

``--prefill``: instead, one row's chunked KDA prefill (``kda.chunk_kda_cuda``, fla) of T tokens from a random
state, eagerly (``UNIMEM_KDA_GRAPHS=0``) and replayed from ops/kda_graphs' graph of T's bucket: host time of a
call (``perf_counter`` until it returns, the device idle before it), wall time of a call (synchronised), and the
kernels' time alone (fla replayed from a CUDA graph by do_bench_cudagraph); medians of 30 calls.

usage: python benchmarks/bench_kda.py --out results.json [--batches 64 256] [--sweep] [--prefill]
(on the GPU machine: ``source benchmarks/device_env.sh`` first; keep TRITON_INTERPRET unset or 0)
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from unimem_compile.ops import kda
from unimem_compile.pool import LinearStateSpec, UnifiedPool, state_views

H, K, V, CONV_K = 32, 128, 128, 4
C = 3 * H * K
POOL_SLOTS = 512


def copy_bandwidth(device) -> float:
    """Device-to-device copy of 1 GiB, counting read + write, in bytes/s."""
    n = 1 << 30
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * n / (ms * 1e-3)


def timed(calls) -> dict:
    """Median time of one call, in us. ``calls`` touch disjoint slot sets in turn, so no call finds its
    states in L2 (do_bench also flushes L2 between reps; CUDA-graph replays do not)."""
    def run():
        for c in calls:
            c()

    eager = do_bench(run, return_mode="median")
    graph = do_bench_cudagraph(run, return_mode="median")
    return {"eager_us": eager * 1e3 / len(calls), "graph_us": graph * 1e3 / len(calls)}


def decode_bytes(b: int) -> int:
    state = 2 * b * H * K * V * 4
    inputs = b * H * (2 * K * 2 + V * 2 + K * 4 + 2)  # q, k, v bf16, g fp32, beta bf16
    return state + inputs + b * H * V * 2  # + out bf16


def conv_bytes(b: int) -> int:
    return 2 * b * C * CONV_K * 2 + 2 * b * C * 2 + C * CONV_K * 2


def make_pool(device, gen):
    spec = LinearStateSpec.kda(1, H, K, CONV_K, torch.bfloat16)
    pool = UnifiedPool.for_capacity(None, spec, 64, 0, POOL_SLOTS, device)
    ids = pool.alloc_slots(POOL_SLOTS)
    conv_view, rec_view = state_views(pool.arena, pool.layout, 0)
    live = rec_view[pool.layout.first_slot:]
    for i in range(0, live.shape[0], 64):  # in pieces: one randn of the whole pool would double its memory
        part = live[i:i + 64]
        part.copy_(torch.randn(part.shape, device=device, generator=gen) * 0.05)
    cv_live = conv_view[pool.layout.first_slot:]
    cv_live.copy_(torch.randn(cv_live.shape, device=device, generator=gen).bfloat16())
    return pool, spec, ids


def decode_inputs(b, device, gen):
    q = torch.randn(b, H, K, device=device, generator=gen).bfloat16()
    k = torch.randn(b, H, K, device=device, generator=gen).bfloat16()
    v = torch.randn(b, H, V, device=device, generator=gen).bfloat16()
    g = -torch.rand(b, H, K, device=device, generator=gen) * 0.5 - 0.01
    beta = torch.rand(b, H, device=device, generator=gen).bfloat16()
    return q, k, v, g, beta


def fla_decode():
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception:  # not installed or not importable with this torch/triton: skip the column
        return None
    return fused_recurrent_kda_fwd


PREFILL_TOKENS = (64, 256, 1000, 1024, 4096)


def prefill_rows(device, gen) -> list[dict]:
    """``--prefill`` (module docstring): one dict per (T, path)."""
    import statistics
    import time

    from unimem_compile import env
    from unimem_compile.ops.kda_graphs import GRAPHS

    chunk = kda.fla_chunk_kda()
    if chunk is None:
        raise SystemExit("bench_kda --prefill: flash-linear-attention does not import here")
    rows = []
    for t in PREFILL_TOKENS:
        q = torch.randn(1, t, H, K, device=device, generator=gen).bfloat16()
        k = torch.randn(1, t, H, K, device=device, generator=gen).bfloat16()
        v = torch.randn(1, t, H, V, device=device, generator=gen).bfloat16()
        g = -torch.rand(1, t, H, K, device=device, generator=gen) * 1.5 - 0.01
        beta = torch.rand(1, t, H, device=device, generator=gen).bfloat16()
        state = torch.randn(1, H, K, V, device=device, generator=gen) * 0.5

        def call():
            return kda.chunk_kda_cuda(q, k, v, g, beta, state, K ** -0.5, True, op="bench_kda")

        kernel_us = 1e3 * do_bench_cudagraph(lambda: chunk(q, k, v, g, beta, scale=K ** -0.5, initial_state=state,
                                                           output_final_state=True, use_qk_l2norm_in_kernel=True),
                                             return_mode="median")
        for path, flag in (("eager", "0"), ("graph", "1")):
            host, wall = [], []
            with env.overridden(env.KDA_GRAPHS, flag):
                for _ in range(3):  # autotune / capture
                    call()
                for _ in range(30):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    call()
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    host.append((t1 - t0) * 1e6)
                    wall.append((time.perf_counter() - t0) * 1e6)
            rows.append({"tokens": t, "path": path, "host_us": statistics.median(host),
                         "wall_us": statistics.median(wall), "kernel_us": kernel_us})
    print(f"{'tokens':>6s} {'path':6s} {'host us':>9s} {'wall us':>9s} {'kernels us':>10s}")
    for r in rows:
        print(f"{r['tokens']:6d} {r['path']:6s} {r['host_us']:9.1f} {r['wall_us']:9.1f} {r['kernel_us']:10.1f}")
    print(f"graphs: {len(GRAPHS)} captured, static buffers {GRAPHS.nbytes() / 2**20:.1f} MiB")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--sweep", action="store_true", help="also time kda_decode_triton over block_v x num_warps")
    ap.add_argument("--prefill", action="store_true", help="time the chunked prefill, eager fla vs its graphs")
    args = ap.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    if args.prefill:
        rows = prefill_rows(device, gen)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "python": platform.python_version(), "geometry": {"heads": H, "k": K, "v": V},
                       "prefill": rows}, f, indent=2)
        return

    ceiling = copy_bandwidth(device)
    pool, spec, ids = make_pool(device, gen)
    fla = fla_decode()
    fla_pool = None
    if fla is not None:
        fla_pool = torch.randn(POOL_SLOTS, H, K, V, device=device, generator=gen) * 0.05
    off, conv_off, sb = spec.recurrent_offset(0), spec.conv_offset(0), spec.slot_bytes
    scale = K ** -0.5
    rows, sweep = [], []
    perm = torch.randperm(POOL_SLOTS, device=device, generator=gen)

    for b in args.batches:
        sets = [perm[i * b:(i + 1) * b] for i in range(POOL_SLOTS // b)]  # disjoint pool positions
        slot_sets = [torch.tensor(ids, device=device)[p] for p in sets]
        q, k, v, g, beta = decode_inputs(b, device, gen)

        def ours(slots, bv=32, warps=4):
            return lambda: kda.kda_decode_triton(q, k, v, g, beta, pool.arena, pool.s_v2p, slots, off, sb, scale, True,
                                                 block_v=bv, num_warps=warps)

        def op(slots):
            return lambda: torch.ops.unimem.kda_decode(q, k, v, g, beta, pool.arena, pool.s_v2p, slots, off, sb, scale,
                                                       True)

        def row(name, calls, nbytes):
            t = timed(calls)
            rows.append({"kernel": name, "batch": b, "bytes": nbytes, **t,
                         "eager_fraction": nbytes / (t["eager_us"] * 1e-6) / ceiling,
                         "graph_fraction": nbytes / (t["graph_us"] * 1e-6) / ceiling})

        nbytes = decode_bytes(b)
        row("unimem.kda_decode (op)", [op(s) for s in slot_sets], nbytes)
        row("kda_decode_triton bv32 (fla tile)", [ours(s) for s in slot_sets], nbytes)  # the old default
        if fla is not None:
            q4, k4, v4, g4, b3 = q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None]
            out = torch.empty_like(v4)

            def theirs(idx):
                return lambda: fla(q=q4, k=k4, v=v4, g=g4, beta=b3, initial_state=fla_pool, scale=scale,
                                   inplace_final_state=True, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
                                   out=out)

            row("fla fused_recurrent_kda_fwd", [theirs(p.contiguous()) for p in sets], nbytes)

        x = torch.randn(b, C, device=device, generator=gen).bfloat16()
        w = (torch.randn(C, CONV_K, device=device, generator=gen) * 0.5).bfloat16()

        def conv(slots):
            return lambda: torch.ops.unimem.causal_conv1d_update(x, pool.arena, pool.s_v2p, slots, conv_off, sb, w, None,
                                                                 "silu")

        row("unimem.causal_conv1d_update (op)", [conv(s) for s in slot_sets], conv_bytes(b))

        if args.sweep:
            for bv in (16, 32, 64, 128):
                for warps in (1, 2, 4, 8):
                    try:
                        t = timed([ours(s, bv, warps) for s in slot_sets])
                    except Exception as e:  # e.g. out of registers/shared memory for a large tile
                        sweep.append({"batch": b, "block_v": bv, "num_warps": warps, "error": repr(e)[:200]})
                        continue
                    sweep.append({"batch": b, "block_v": bv, "num_warps": warps, "graph_us": t["graph_us"],
                                  "graph_fraction": nbytes / (t["graph_us"] * 1e-6) / ceiling})

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"fla: {'yes' if fla is not None else 'not importable (column skipped)'}")
    print(f"copy bandwidth (read + write, 1 GiB): {ceiling / 1e12:.2f} TB/s")
    print(f"{'kernel':36s} {'batch':>5s} {'MB':>8s} {'eager us':>9s} {'frac':>6s} {'graph us':>9s} {'frac':>6s}")
    for r in rows:
        print(f"{r['kernel']:36s} {r['batch']:5d} {r['bytes'] / 1e6:8.1f} {r['eager_us']:9.1f} "
              f"{r['eager_fraction']:6.3f} {r['graph_us']:9.1f} {r['graph_fraction']:6.3f}")
    if sweep:
        print("sweep of kda_decode_triton (CUDA graph):")
        for s in sweep:
            detail = s.get("error") or f"{s['graph_us']:8.1f} us  {s['graph_fraction']:.3f}"
            print(f"  batch {s['batch']:4d} block_v {s['block_v']:3d} num_warps {s['num_warps']}: {detail}")
    fla_version = None
    if fla is not None:
        import fla as fla_pkg
        fla_version = getattr(fla_pkg, "__version__", "?")
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "fla": fla_version,
        "geometry": {"heads": H, "k": K, "v": V, "conv_channels": C, "conv_kernel": CONV_K,
                     "pool_slots": POOL_SLOTS, "slot_bytes": sb},
        "copy_bytes_per_s": ceiling, "rows": rows, "sweep": sweep,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
