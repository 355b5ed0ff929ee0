"""Paged MLA prefill: unimem::mla_prefill against today's path and stock SDPA, one row of 4k, 32k and 128k
tokens prefilled in 4k chunks, with the achieved TFLOP/s against the bf16 matmul ceiling measured in the same run.

Geometry: Kimi-Linear MLA (32 heads, kv_lora_rank 512 + rope 64, dn 128, dv 128, a 7-layer page envelope),
page size 64, bf16, the row's pages permuted at random over the arena. Each chunk's latent rows are on the pages
before the chunk is timed (what the cache does before attention runs); q is a random ``[1, 32, 4096, 192]``
view of a ``[1, 4096, 32, 192]`` projection, as transformers hands it to attention.

Systems, per chunk (``triton.testing.do_bench`` medians):
- ``unimem``: ``torch.ops.unimem.mla_prefill`` (gather + expansion + our attention per workspace piece), with
  the host copy of the lengths; ``unimem_sync`` (32k row only): the same without it (one device sync per call).
- ``old_path``: what a prefill graph does today: ``mla_gather`` over ``max_seq_len`` positions (here the row's
  final length, the best case for it), expansion through ``kv_b_proj``, key assembly, SDPA under a
  ``[1, 1, 4096, max_seq_len]`` boolean mask (built outside the timing: transformers builds it once per forward).
  Its cost does not depend on the chunk, so the first and the last chunk are timed and the total is chunks x
  their mean.
- ``stock_sdpa``: stock SDPA alone over an already expanded, contiguous history of the exact length
  (``causal_lower_right`` bias: the chunk's queries at the end), i.e. attention with no gather and no
  expansion: the floor for an unfused expanded-cache design.

TFLOP/s: useful FLOPs as ``mla_prefill_flops`` counts them (expansion of the row's stored tokens + causal
attention pairs, ops/mla_prefill.py), the same count for every system, over the median time.

usage: python benchmarks/bench_mla_prefill.py [--out results.json] [--quick] [--sweep]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention.bias import causal_lower_right

from unimem_compile.ops import mla_prefill as mp

H, R, DR, DN, DV, L, LAYER, PS = 32, 512, 64, 128, 128, 7, 3, 64
D = R + DR
DT = torch.bfloat16
SCALE = (DN + DR) ** -0.5
CHUNK = 4096


def matmul_ceiling_tflops(n: int = 8192) -> float:
    """bf16 cuBLAS matmul ``n^3`` on random data, TFLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=DT)
    b = torch.randn(n, n, device="cuda", dtype=DT)
    ms = triton.testing.do_bench(lambda: torch.mm(a, b), warmup=50, rep=300)
    return 2 * n**3 / ms / 1e9


class Row:
    """One row of ``tokens`` random latent rows (never zeros) of layer LAYER in a 7-layer page envelope, its
    pages a random permutation of the arena's (page 0 is the sink), and a random ``kv_b_proj`` weight."""

    def __init__(self, tokens: int, seed: int = 0):
        self.tokens = tokens
        pages = tokens // PS
        page_bytes = PS * L * D * 2
        self.arena = torch.zeros((pages + 2) * page_bytes, dtype=torch.uint8, device="cuda")  # sink + tail pad
        g = torch.Generator(device="cuda").manual_seed(seed)
        typed = self.arena.view(DT)
        chunk = 2**28
        for i in range(page_bytes // 2, typed.numel(), chunk):
            typed[i: i + chunk].normal_(generator=g)
        self.v2p = torch.full((pages + 1,), -1, dtype=torch.int64, device="cuda")
        self.v2p[1:] = torch.randperm(pages, device="cuda", generator=g) + 1
        self.page_table = (torch.arange(pages, dtype=torch.int32, device="cuda") + 1)[None]
        self.w = (torch.randn(H * (DN + DV), R, device="cuda", generator=g) / math.sqrt(R)).to(DT)
        self.q = torch.randn(1, CHUNK, H, DN + DR, device="cuda", generator=g).to(DT).transpose(1, 2)
        self.g = g

    def args(self, kv_len: int, workspace: int, host: bool = True):
        """The op's arguments for a chunk ending at ``kv_len`` (build them outside the timed call: the
        tensors are uploaded here)."""
        host_len = torch.tensor([kv_len], dtype=torch.int32)
        return (self.q, self.arena, self.v2p, self.page_table, host_len.cuda(), host_len if host else None, self.w,
                SCALE, workspace, LAYER, L, PS, R, DR, DT)

    def geometry(self):
        return (LAYER, L, PS, R, DR, DT)

    def expanded(self):
        """The whole row expanded as transformers' expand_kv does: K ``[1, H, n, dn + Dr]``, V ``[1, H, n, dv]``,
        contiguous."""
        kv_len = torch.tensor([self.tokens], dtype=torch.int32, device="cuda")
        full = torch.ops.unimem.mla_gather(self.arena, self.v2p, self.page_table, kv_len, torch.zeros_like(kv_len),
                                           self.tokens, *self.geometry())
        kv = F.linear(full[:, :, :R], self.w).view(1, self.tokens, H, DN + DV).transpose(1, 2)
        k = torch.cat([kv[..., :DN], full[:, None, :, R:].expand(1, H, self.tokens, DR)], -1).contiguous()
        return k, kv[..., DN:].contiguous()


def old_path(row: Row, lens: torch.Tensor, max_len: int, mask: torch.Tensor) -> torch.Tensor:
    """Today's prefill graph for one MLA layer: gather max_len positions, expand, assemble K, masked SDPA.
    ``lens``: int32 ``[2]`` on the GPU, the row's kv_len and its out_offset (0)."""
    full = torch.ops.unimem.mla_gather(row.arena, row.v2p, row.page_table, lens[:1], lens[1:], max_len,
                                       *row.geometry())
    latent, k_rot = full[:, None, :, :R], full[:, None, :, R:]
    kv = F.linear(latent, row.w).view(1, max_len, H, DN + DV).transpose(1, 2)
    k_nope, v = kv.split([DN, DV], -1)
    k = kv.new_empty(1, H, max_len, DN + DR)
    k[..., :DN].copy_(k_nope)
    k[..., DN:].copy_(k_rot.expand(1, H, max_len, DR))
    return F.scaled_dot_product_attention(row.q, k, v, attn_mask=mask, scale=SCALE)


def causal_mask(kv_len: int, max_len: int) -> torch.Tensor:
    pos = kv_len - CHUNK + torch.arange(CHUNK, device="cuda")
    return (torch.arange(max_len, device="cuda")[None, :] <= pos[:, None])[None, None]


def bench(fn, rep: int = 60) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=rep)


def useful_flops(kv_len: int) -> int:
    f = mp.mla_prefill_flops([kv_len], CHUNK, H, DN, DR, DV, R)
    return f["expand"] + f["attention"]


def run_row(tokens: int, workspace: int, ceiling: float, *, sync: bool) -> dict:
    row = Row(tokens)
    k_full, v_full = row.expanded()
    chunks = []
    for c in range(tokens // CHUNK):
        kv_len = (c + 1) * CHUNK
        flops = useful_flops(kv_len)
        a = row.args(kv_len, workspace)
        ms = bench(lambda: torch.ops.unimem.mla_prefill(*a))
        stock_ms = bench(lambda: F.scaled_dot_product_attention(
            row.q, k_full[:, :, :kv_len], v_full[:, :, :kv_len], attn_mask=causal_lower_right(CHUNK, kv_len),
            scale=SCALE))
        point = {"kv_len": kv_len, "flops": flops, "ms": ms, "tflops": flops / ms / 1e9,
                 "fraction_of_matmul": flops / ms / 1e9 / ceiling, "stock_sdpa_ms": stock_ms}
        if sync:
            a_sync = row.args(kv_len, workspace, host=False)
            point["sync_ms"] = bench(lambda: torch.ops.unimem.mla_prefill(*a_sync))
        chunks.append(point)
        print(f"{tokens:>7} {kv_len:>7} {ms:>9.2f} {point['tflops']:>7.1f} {point['fraction_of_matmul']:>6.2f} "
              f"{stock_ms:>9.2f}" + (f" {point['sync_ms']:>9.2f}" if sync else ""))
    del k_full, v_full
    old = []
    for kv_len in sorted({CHUNK, tokens}):
        mask = causal_mask(kv_len, tokens)
        lens = torch.tensor([kv_len, 0], dtype=torch.int32, device="cuda")
        old.append({"kv_len": kv_len, "ms": bench(lambda: old_path(row, lens, tokens, mask), rep=200)})
        del mask
    n = len(chunks)
    total = sum(p["ms"] for p in chunks)
    flops = sum(p["flops"] for p in chunks)
    old_total = n * sum(p["ms"] for p in old) / len(old)
    stock_total = sum(p["stock_sdpa_ms"] for p in chunks)
    out = {
        "tokens": tokens, "chunk": CHUNK, "chunks": chunks, "flops": flops,
        "unimem": {"total_ms": total, "tflops": flops / total / 1e9,
                   "fraction_of_matmul": flops / total / 1e9 / ceiling, "tokens_per_s": tokens / total * 1e3},
        "old_path": {"max_seq_len": tokens, "timed_chunks": old, "total_ms": old_total,
                     "tflops": flops / old_total / 1e9, "unimem_speedup": old_total / total},
        "stock_sdpa": {"total_ms": stock_total, "tflops": flops / stock_total / 1e9,
                       "unimem_speedup": stock_total / total},
    }
    if sync:
        sync_total = sum(p["sync_ms"] for p in chunks)
        out["unimem_sync"] = {"total_ms": sync_total, "overhead_of_sync": sync_total / total - 1}
    print(f"{tokens:>7} total: unimem {total:.1f} ms ({out['unimem']['tflops']:.0f} TFLOP/s, "
          f"{out['unimem']['fraction_of_matmul']:.2f} of matmul), old path {old_total:.1f} ms "
          f"({out['old_path']['unimem_speedup']:.1f}x), stock SDPA alone {stock_total:.1f} ms "
          f"({out['stock_sdpa']['unimem_speedup']:.2f}x)")
    return out


#: the --sweep grid: (block_m, block_n, num_warps, num_stages); the first is the sm_90 default
SWEEP_TILES = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (128, 128, 8, 2), (128, 64, 4, 2),
               (64, 64, 4, 3), (64, 128, 4, 2), (64, 64, 8, 3)]
SWEEP_WORKSPACES = [4096, 8192, 16384, 32768]


def sweep(ceiling: float) -> list[dict]:
    """Tile and workspace grid at the last chunk of a 32k row (history 28k + 4k new) and at a first chunk
    (4k, causal only). A configuration that does not fit the GPU is recorded with its error."""
    row = Row(32768)
    points = []
    for kv_len in (32768, CHUNK):
        flops = useful_flops(kv_len)
        configs = [(t, mp.WORKSPACE_TOKENS) for t in SWEEP_TILES] + [(SWEEP_TILES[0], w) for w in SWEEP_WORKSPACES]
        for (bm, bn, warps, stages), ws in configs:
            kw = {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages}
            point = {"kv_len": kv_len, "workspace_tokens": ws, **kw}
            a = row.args(kv_len, ws)
            try:
                point["ms"] = bench(lambda: mp.mla_prefill_triton(*a, **kw))
                point["tflops"] = flops / point["ms"] / 1e9
                point["fraction_of_matmul"] = point["tflops"] / ceiling
                print(f"sweep kv_len {kv_len:>6} ws {ws:>6} {bm:>4}x{bn:<4} w{warps} s{stages}: {point['ms']:.2f} ms "
                      f"{point['tflops']:.0f} TFLOP/s")
            except Exception as e:  # noqa: BLE001 - out of shared memory / registers: record and go on
                point["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                print(f"sweep {point}")
            points.append(point)
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="rows of 4k and 32k only")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tiles and workspace sizes")
    ap.add_argument("--workspace", type=int, default=mp.WORKSPACE_TOKENS, help="workspace_tokens of the op")
    args = ap.parse_args()
    ceiling = matmul_ceiling_tflops()
    tiles = mp.mla_prefill_tiles(torch.device("cuda"), CHUNK)
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "conditions": f"bf16, {H} heads, R {R} + Dr {DR}, dn {DN}, dv {DV}, {L}-layer page envelope, page size "
                      f"{PS}, one row on randomly permuted pages, chunks of {CHUNK}, do_bench medians",
        "matmul_ceiling_tflops": ceiling, "workspace_tokens": args.workspace, "tiles": tiles, "rows": [],
    }
    print(f"bf16 matmul ceiling: {ceiling:.0f} TFLOP/s; tiles {tiles}; workspace {args.workspace} tokens")
    print(f"{'row':>7} {'kv_len':>7} {'ms':>9} {'TFLOP/s':>7} {'of mm':>6} {'sdpa ms':>9} {'sync ms':>9}")
    for tokens in ([4096, 32768] if args.quick else [4096, 32768, 131072]):
        result["rows"].append(run_row(tokens, args.workspace, ceiling, sync=tokens == 32768))
        torch.cuda.empty_cache()
    if args.sweep:
        result["sweep"] = sweep(ceiling)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
