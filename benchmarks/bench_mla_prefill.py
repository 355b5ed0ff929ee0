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
``sync_in_stream`` (32k row, last chunk): what the piece count's device sync costs where it happens in a
model, behind other queued work: ``LAYERS_IN_STREAM`` x (a ``[4096, 2304] x [2304, 9216]`` matmul standing in
for the rest of a layer, then the op), with the host copy of the lengths and without it; the difference per
op call is the sync's cost (the ``mla_prefill`` rewrite passes no host copy: docs/passes.md).

``--model NAME`` (model level, ``model_level``): a whole prefill of one row (``--batch B``: B rows together, the
FLOPs, bound and tokens/s counting every row) of 4k, 32k and 128k random tokens
in 4k chunks (``generate(max_new_tokens=1, prefill_chunk_size=4096)``: the prefill and one sampled token),
best of ``--repeats`` after an untimed warm-up that compiles (:func:`warm_up_tokens`: two chunks, and three
workspace pieces of history where the rows reach that), for three systems with the same seeded
weights (bf16 on CUDA): ``unimem`` (``unimem_compile.compile``, every rewrite: ``mla_prefill`` on the
pages), ``old_path`` (every rewrite but ``mla_prefill``: each chunk gathers and expands ``max_seq_len``
positions, today's prefill graph; the branch before chunked prefill could not chunk at all), ``stock``
(stock transformers' chunked prefill on its DynamicCache, eager). One ``max_seq_len`` (the longest row + 16)
for every row, as a deployment has. Reported per row and system: prefill ms, prefill tokens/s, the peak
memory above what was allocated before the run, graphs compiled during the timed runs (must be 0), the
Triton compiles of each timed run (``triton_compiles_per_run``: a run that compiled is confounded; on
2026-12-04 the first 32k run took 2.3-2.6 s after a warm-up of two chunks, whose history never spanned the
three workspace pieces a 32k row's last chunks do: most likely those launches' first compiles), and
against the matmul FLOP bound:

    bound = FLOPs / the bf16 cuBLAS matmul ceiling measured in the same run

with FLOPs counted for one prefill of the row (``model_prefill_flops``): every ``nn.Linear`` of the layers
once per token (attention projections, ``kv_b_proj`` included; dense MLPs; shared experts), the routed
experts' matmuls for ``num_experts_per_tok`` experts per token, the router; MLA attention ``2 H (dn + Dr +
dv)`` per causal (query, key) pair (``N (N + 1) / 2`` pairs for ``N`` tokens, no pads); KDA ``6 H K V`` per
token (the recurrence's three ``K x V`` products: ``k^T S``, the rank-1 update, ``q S``; the chunked form's
extra intra-chunk work is not counted); the LM head for one position per chunk (generate asks for the last
position's logits only). Not counted: elementwise work, norms, the convolution, softmax, and the history's
re-expansion that ``mla_prefill`` does in every chunk (reported beside it as ``reexpansion_flops``; a
design that kept the expanded history would not do it). ``x_of_bound`` = measured / bound.
``--profile-row N`` prefills row N once more per system under ``torch.profiler`` after its timed runs and records
``profile``: kernel time per name and per part of the model (``kernel_breakdown``: matmul, MLA attention, MLA
cache, KDA, conv, MoE routing, Inductor's fused kernels, other) and the GPU's busy fraction of the wall time.

``--short`` (only this): chunks of 16, 64 and 256 queries over 32k tokens of history, the op with split-K
off, by ``mla_prefill_num_splits`` and forced to 2-16 splits (``short_chunks``; do_bench medians, and for
off and the rule also CUDA-graph replays, ``*_graph_ms``, which leave out the launcher's host work).

usage: python benchmarks/bench_mla_prefill.py [--out results.json] [--quick] [--sweep]
       python benchmarks/bench_mla_prefill.py --short [--out results_short.json]
       python benchmarks/bench_mla_prefill.py --model kimi-linear-48b-4l [--rows 4096 32768 131072] [--out f.json]
       python benchmarks/bench_mla_prefill.py --model kimi-linear-tiny --device cpu --rows 64 96 --chunk 32 \
           --backend aot_eager                                          (CPU smoke run, ~30 s)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention.bias import causal_lower_right

from unimem_compile.ops import mla_prefill as mp
from unimem_compile.ops.kda import kda_prefill_backend

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


#: matmul + op pairs per timed call of the sync_in_stream measurement
LAYERS_IN_STREAM = 8


def sync_in_stream(row: Row, kv_len: int, workspace: int) -> dict:
    """The op behind other queued work, with and without the host copy of the lengths (module docstring)."""
    x = torch.randn(CHUNK, 2304, device="cuda", dtype=DT)
    w = torch.randn(2304, 9216, device="cuda", dtype=DT)
    out = {}
    for name, host in (("host_lengths_ms", True), ("sync_ms", False)):
        a = row.args(kv_len, workspace, host=host)

        def layers():
            for _ in range(LAYERS_IN_STREAM):
                torch.mm(x, w)
                torch.ops.unimem.mla_prefill(*a)

        out[name] = bench(layers)
    out["sync_cost_per_call_ms"] = (out["sync_ms"] - out["host_lengths_ms"]) / LAYERS_IN_STREAM
    out["layers"] = LAYERS_IN_STREAM
    return out


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
        out["sync_in_stream"] = sync_in_stream(row, tokens, workspace)
        print(f"{tokens:>7} sync in a busy stream: {out['sync_in_stream']['sync_cost_per_call_ms'] * 1e3:.0f} us "
              "per call")
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


#: --short: chunk lengths (queries) timed over SHORT_HISTORY tokens of history, and the forced split counts
SHORT_CHUNKS = (16, 64, 256)
SHORT_HISTORY = 32768
SHORT_SPLITS = (2, 4, 8, 16)


def short_chunks(ceiling: float, workspace: int) -> list[dict]:
    """Short chunks over a long history, split-K off and on: for each chunk of ``T`` queries in SHORT_CHUNKS
    after SHORT_HISTORY tokens (kv_len = history + T, one row), the op with ``num_splits=1`` (the unsplit
    kernel), with the counts ``mla_prefill_num_splits`` picks per piece (``rule``, what ``SPLIT_K_AUTO``
    would run), and with every count in SHORT_SPLITS forced on every piece. ``rule_splits``: the rule's count
    per workspace piece at this device's SM count and the default tiles; ``max_abs_diff_vs_unsplit``: the
    largest difference of a forced split's output from the unsplit one."""
    tokens = SHORT_HISTORY + max(SHORT_CHUNKS)
    row = Row(-(-tokens // PS) * PS)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    points = []
    for T in SHORT_CHUNKS:
        kv_len = SHORT_HISTORY + T
        tiles = mp.mla_prefill_tiles(torch.device("cuda"), T)
        f = mp.mla_prefill_flops([kv_len], T, H, DN, DR, DV, R)
        flops = f["expand"] + f["attention"]
        a = list(row.args(kv_len, workspace))
        a[0] = row.q[:, :, :T]  # [1, H, T, dq], last stride 1
        programs = H * triton.cdiv(T, tiles["block_m"])
        piece_keys = [min(workspace, kv_len - p * workspace) for p in range(-(-kv_len // workspace))]
        rule = [mp.mla_prefill_num_splits(programs, triton.cdiv(k, tiles["block_n"]), sms) for k in piece_keys]
        point = {"queries": T, "history": SHORT_HISTORY, "kv_len": kv_len, "flops": flops,
                 "attention_flops": f["attention"], "expand_flops": f["expand"], "programs": programs, "sms": sms,
                 "rule_splits": rule, "tiles": tiles}
        ref = mp.mla_prefill_triton(*a, num_splits=1).float()
        # sanity of the split results on this GPU (bf16 outputs: rounding apart)
        point["max_abs_diff_vs_unsplit"] = max(
            (mp.mla_prefill_triton(*a, num_splits=n).float() - ref).abs().max().item() for n in SHORT_SPLITS)
        unsplit = bench(lambda: mp.mla_prefill_triton(*a, num_splits=1))
        point["unsplit_ms"] = unsplit
        # the same launches replayed from a CUDA graph: GPU time without the launcher's host work (a short
        # chunk's few microseconds of attention may hide behind it)
        point["unsplit_graph_ms"] = triton.testing.do_bench_cudagraph(lambda: mp.mla_prefill_triton(*a, num_splits=1))
        auto_was = mp.SPLIT_K_AUTO
        mp.SPLIT_K_AUTO = True  # the rule, as the switch would run it (restored below)
        try:
            point["rule_ms"] = bench(lambda: mp.mla_prefill_triton(*a))
            point["rule_graph_ms"] = triton.testing.do_bench_cudagraph(lambda: mp.mla_prefill_triton(*a))
        finally:
            mp.SPLIT_K_AUTO = auto_was
        point["forced"] = [{"num_splits": n, "ms": bench(lambda: mp.mla_prefill_triton(*a, num_splits=n))}
                           for n in SHORT_SPLITS]
        for key in ("unsplit", "rule"):
            point[f"{key}_tflops"] = flops / point[f"{key}_ms"] / 1e9
            point[f"{key}_fraction_of_matmul"] = point[f"{key}_tflops"] / ceiling
        point["rule_speedup"] = unsplit / point["rule_ms"]
        point["rule_graph_speedup"] = point["unsplit_graph_ms"] / point["rule_graph_ms"]
        forced = " ".join(f"{p['num_splits']}:{p['ms']:.3f}" for p in point["forced"])
        print(f"short T {T:>4} over {SHORT_HISTORY}: unsplit {unsplit:.3f} ms, rule {rule} {point['rule_ms']:.3f} ms "
              f"({point['rule_speedup']:.2f}x; graph replay {point['unsplit_graph_ms']:.3f} vs "
              f"{point['rule_graph_ms']:.3f} ms, {point['rule_graph_speedup']:.2f}x), forced {forced}")
        points.append(point)
    return points


# ---------------------------------------------------------------------------------------------- model level
MODEL_SYSTEMS = ("unimem", "old_path", "stock")
MODEL_ROWS = (4096, 32768, 131072)


def model_prefill_flops(model, tokens: int, chunk: int) -> dict:
    """Matmul FLOPs of one prefill of ``tokens`` tokens (one row, no pads) in chunks of ``chunk``, counted as the
    module docstring says: ``{"linear", "mla_attention", "kda", "lm_head", "total", "reexpansion_flops"}``."""
    cfg = model.config
    lm_head = model.get_output_embeddings()
    top_k = getattr(cfg, "num_experts_per_tok", 0) or 0
    per_token = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            if module is not lm_head:
                per_token += 2 * module.in_features * module.out_features
            continue
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter) and gate_up.dim() == 3:
            per_token += 2 * top_k * (gate_up[0].numel() + down[0].numel())  # routed experts, top-k of them
        weight = getattr(module, "weight", None)
        if (isinstance(weight, torch.nn.Parameter) and weight.dim() == 2 and not isinstance(module, torch.nn.Embedding)
                and module is not lm_head):
            per_token += 2 * weight.numel()  # the router
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    mla_layers = sum(t == "full_attention" for t in types)
    kda_layers = sum(t == "linear_attention" for t in types)
    H = cfg.num_attention_heads
    dn, dr, dv, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    pairs = tokens * (tokens + 1) // 2
    mla = mla_layers * 2 * H * (dn + dr + dv) * pairs
    kda = 0
    if kda_layers:
        kda = kda_layers * 6 * cfg.linear_num_heads * cfg.linear_head_dim * cfg.linear_head_dim * tokens
    chunks = -(-tokens // chunk)
    head = chunks * 2 * lm_head.in_features * lm_head.out_features
    stored = sum(min(tokens, (c + 1) * chunk) for c in range(chunks))
    linear = per_token * tokens
    return {"linear": linear, "mla_attention": mla, "kda": kda, "lm_head": head,
            "total": linear + mla + kda + head,
            "reexpansion_flops": mla_layers * 2 * R * H * (dn + dv) * (stored - tokens)}


def _matmul_ceiling(device: torch.device, dtype: torch.dtype) -> float:
    """TFLOP/s of an ``n^3`` matmul on ``device`` (CUDA: bf16 cuBLAS at 8192, the op-level ceiling)."""
    if device.type == "cuda":
        return matmul_ceiling_tflops()
    a = torch.randn(1024, 1024, dtype=dtype)
    t = time.perf_counter()
    for _ in range(5):
        torch.mm(a, a)
    return 5 * 2 * 1024**3 / (time.perf_counter() - t) / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(system: str, name: str, device: torch.device, dtype: torch.dtype, max_seq_len: int, backend: str,
           batch: int = 1):
    import unimem_compile
    from unimem_compile.hf.models import build_model
    from unimem_compile.passes import REWRITE_NAMES

    model = build_model(name, dtype=dtype, device=device, seed=0)
    if system != "stock":
        passes = True if system == "unimem" else [n for n in REWRITE_NAMES if n != "mla_prefill"]
        unimem_compile.compile(model, max_batch_size=batch, max_seq_len=max_seq_len, page_size=PS if device.type ==
                               "cuda" else 16, backend=backend, passes=passes)
    return model


def _prefill(model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                              do_sample=False, prefill_chunk_size=chunk)


def _graphs(model) -> int | None:
    handle = getattr(model, "unimem", None)
    return handle.passes.graphs if handle is not None else None


# kernel (CUDA) or operator (CPU) names -> the part of a prefill they belong to; the first pattern that matches
# wins, so the specific ones come first (an Inductor kernel fused around a matmul is named triton_*_mm_*)
PROFILE_CATEGORIES = (
    ("mla_attention", r"mla_prefill|mla_decode|flash|fmha|attention|sdpa"),
    ("mla_cache", r"mla_kv_write|mla_gather|translate"),
    ("kda", r"kda|chunk_|l2norm|gated_delta|fused_recurrent|solve_tril|wy_|recompute_w_u|cumsum"),
    ("conv", r"conv"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|sm90_|grouped_mm|_mm_|aten::(mm|addmm|bmm|matmul|linear)$"),
    ("moe_routing", r"topk|sort|histc|bincount|scatter|gather|index|nonzero"),
    ("inductor_fused", r"^triton_"),
)


def profile_category(name: str) -> str:
    """The :data:`PROFILE_CATEGORIES` entry a kernel / operator name falls in (case-insensitive search), else
    ``"other"``."""
    for category, pattern in PROFILE_CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return category
    return "other"


#: CUDA runtime / driver calls by what they cost the host: a launch enqueues work; a blocking call waits for
#: the GPU (a synchronisation, or a copy to pageable host memory, which waits for the stream first)
HOST_LAUNCH = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunchKernelExC|cuLaunchKernelEx|cudaGraphLaunch)")
HOST_BLOCKING = re.compile(r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy$|"
                           r"cudaMemcpyAsync|cuMemcpyDtoH)")


def host_summary(cpu_events, wall_ms: float, top: int = 15) -> dict:
    """The host side of a profiled CUDA call from ``(name, self_cpu_ms, calls)`` per CPU event name (runtime
    calls and operators, ``key_averages``): ``launches`` / ``launch_ms`` (kernel launches and their host
    time), ``blocking_calls`` / ``blocking_ms`` (synchronisations and blocking copies: time the host waited for
    the GPU, during which it enqueued nothing), ``other_ms`` (the other events' self time: operators' host code,
    allocations, other runtime calls), ``untraced_ms`` (``wall_ms`` less every event's self time: Python between
    operators, which the profiler does not see), ``top`` (the ``top`` longest names by self time, runtime calls
    included). With the wall and the kernel time it says which bound a chunk: the GPU (blocking_ms large, busy
    high) or the host (busy low, blocking_ms small: other_ms and untraced_ms say where)."""
    launches = launch_ms = blocking = blocking_ms = total = 0.0
    for name, ms, calls in cpu_events:
        total += ms
        if HOST_LAUNCH.match(name):
            launches, launch_ms = launches + calls, launch_ms + ms
        elif HOST_BLOCKING.match(name):
            blocking, blocking_ms = blocking + calls, blocking_ms + ms
    ranked = sorted(cpu_events, key=lambda e: -e[1])[:top]
    return {"launches": int(launches), "launch_ms": launch_ms, "blocking_calls": int(blocking),
            "blocking_ms": blocking_ms, "other_ms": total - launch_ms - blocking_ms,
            "untraced_ms": max(0.0, wall_ms - total),
            "top": [{"name": n[:120], "ms": ms, "calls": int(c)} for n, ms, c in ranked]}


def kernel_breakdown(fn, device: torch.device, top: int = 25) -> dict:
    """Where one call of ``fn`` spends its device time: ``torch.profiler`` over one call (after ``fn`` has run
    once, so compiles are not in it). On CUDA: every kernel's duration (ms), summed per name and per
    :data:`PROFILE_CATEGORIES` category, and ``busy_fraction`` = kernel time / wall time (below 1: the GPU waited
    for the host, or kernels overlapped less than they could). On the CPU: the operators' self time instead
    (``key_averages``), the same categories. Returns ``{"wall_ms", "kernel_ms", "busy_fraction", "by_category":
    {category: {"ms", "fraction", "calls"}}, "top": [{"name", "category", "ms", "calls"}]}`` with ``top`` the
    ``top`` longest names; ``kernel_ms`` is the sum over every name, so the categories' ms add up to it. On CUDA
    also ``host``: :func:`host_summary` of the CPU events (launches, blocking calls, where the rest went)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        fn()
        _sync(device)
        wall_ms = (time.perf_counter() - t) * 1e3
    per_name: dict[str, list] = {}
    if cuda:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                entry = per_name.setdefault(e.name, [0.0, 0])
                entry[0] += e.device_time_total / 1e3
                entry[1] += 1
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                per_name[e.key] = [e.self_cpu_time_total / 1e3, e.count]
    host = None
    if cuda:
        host = host_summary([(e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()
                             if e.self_cpu_time_total > 0], wall_ms)
    kernel_ms = sum(ms for ms, _ in per_name.values())
    by_category: dict[str, dict] = {}
    for name, (ms, calls) in per_name.items():
        c = by_category.setdefault(profile_category(name), {"ms": 0.0, "fraction": 0.0, "calls": 0})
        c["ms"] += ms
        c["calls"] += calls
    for c in by_category.values():
        c["fraction"] = c["ms"] / kernel_ms if kernel_ms else 0.0
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"wall_ms": wall_ms, "kernel_ms": kernel_ms, "busy_fraction": kernel_ms / wall_ms if wall_ms else 0.0,
            "by_category": dict(sorted(by_category.items(), key=lambda kv: -kv[1]["ms"])),
            "top": [{"name": n[:200], "category": profile_category(n), "ms": ms, "calls": calls}
                    for n, (ms, calls) in ranked], **({"host": host} if host is not None else {})}


PY_FRAME = re.compile(r"^.+\.py\(\d+\): ")  # a Python frame event of a with_stack profile: "file.py(line): name"


def host_stacks(fn, top: int = 6, depth: int = 12, per_name: int = 3) -> list[dict]:
    """Which Python code issues the operators with the most host self time in one call of ``fn``:
    ``torch.profiler`` with ``with_stack=True`` (a separate pass: stack recording slows the host, so
    :func:`kernel_breakdown`'s wall and busy fraction come from an unstacked pass), each operator event grouped
    by the ``depth`` innermost Python frame events above it (its ``cpu_parent`` chain). Returns, for the ``top``
    operator names by self CPU time (runtime calls such as ``cudaLaunchKernel`` and Python's own events left
    out: their callers are the operators), ``{"name", "ms", "calls", "stacks":
    [{"ms", "calls", "frames"}]}`` with the ``per_name`` costliest stacks each (``frames`` innermost first, as
    the profiler lists them; compiled code shows the Inductor output file and line)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, with_stack=True) as prof:
        fn()
    totals: dict[str, list] = {}
    stacks: dict[tuple, list] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or e.self_cpu_time_total <= 0 or \
                e.name.startswith(("cuda", "cu", "<built-in")) or PY_FRAME.match(e.name):
            continue
        frames, parent = [], e.cpu_parent
        while parent is not None and len(frames) < depth:  # the Python frames the profiler recorded above the op
            if PY_FRAME.match(parent.name):
                frames.append(parent.name)
            parent = parent.cpu_parent
        t = totals.setdefault(e.name, [0.0, 0])
        t[0] += e.self_cpu_time_total / 1e3
        t[1] += 1
        st = stacks.setdefault((e.name, tuple(frames)), [0.0, 0])
        st[0] += e.self_cpu_time_total / 1e3
        st[1] += 1
    by_name: dict[str, list] = {}
    for (name, frames), (ms, calls) in stacks.items():
        by_name.setdefault(name, []).append({"ms": ms, "calls": calls, "frames": list(frames)})
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": n[:120], "ms": ms, "calls": int(calls),
             "stacks": sorted(by_name[n], key=lambda s: -s["ms"])[:per_name]} for n, (ms, calls) in ranked]


def warm_up_tokens(rows: list[int], chunk: int, workspace: int = mp.WORKSPACE_TOKENS) -> int:
    """Tokens of the untimed warm-up prompt: two chunks (the first-chunk and the later-chunk graphs), and where
    the longest row reaches it, enough for three workspace pieces at the last chunk (``2 * workspace + chunk``),
    so that mla_prefill's first, middle and last piece are all compiled before a timed run (Triton specialises
    its integer arguments equal to 1: the first / last flags); at most the longest row."""
    return min(max(rows), max(2 * chunk, 2 * workspace + chunk))


def _triton_compiles():
    """bench_serving's Triton JIT counter, a context manager (its module imported on first use: it is heavier)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import bench_serving

    return bench_serving.TritonCompiles()


def parse_ab_env(spec: str) -> list[tuple[str, str]]:
    """One ``--ab-env`` variant: ``NAME=VALUE`` or several joined by ``+`` (``A=1+B=x``), as ``[(name, value)]``.
    Raises ValueError for a part without ``=`` or with an empty name."""
    pairs = []
    for part in spec.split("+"):
        name, eq, value = part.partition("=")
        if not eq or not name:
            raise ValueError(f"--ab-env takes NAME=VALUE[+NAME=VALUE...], got {spec!r}")
        pairs.append((name, value))
    return pairs


def _overridden(override):
    """Every ``env.overridden(name, value)`` of ``override`` (a list of pairs) at once, or nothing to do when
    ``override`` is None."""
    from unimem_compile import env

    stack = contextlib.ExitStack()
    for name, value in override or ():
        stack.enter_context(env.overridden(name, value))
    return stack


def burst_prompts(n: int, vocab: int, seed: int = 0, max_tokens: int = 2048) -> list[list[int]]:
    """``n`` random prompts whose lengths follow bench_serving's chat trace (lognormal, median 1024 tokens, sigma
    1.0, clipped to 64..), clipped to ``max_tokens``; below 2048 every length scales by ``max_tokens / 2048``
    (a CPU smoke run). Seeded."""
    import numpy as np

    rng = np.random.default_rng(seed)
    scale = min(1.0, max_tokens / 2048)
    lengths = np.clip(rng.lognormal(math.log(1024 * scale), 1.0, n), max(1, 64 * scale), max_tokens).astype(np.int64)
    return [rng.integers(3, vocab, int(k)).tolist() for k in lengths]


def engine_burst(model, prompts: list[list[int]], budget: int, rows: int) -> dict:
    """Every prompt of ``prompts`` submitted at once to a new continuous-batching manager (``max_prefill_tokens
    = budget``, ``max_prefill_rows = rows``), stepped on this thread until each has its first token
    (``max_new_tokens = 1``). Returns ``{"wall_ms", "ttft_ms": [per prompt, from submission], "forwards",
    "packed_forwards", "packed_rows", "prefill_pads", "failed"}``."""
    device = model.unimem.pool.device
    manager = model.init_continuous_batching(max_prefill_tokens=budget, max_prefill_rows=rows)
    _sync(device)
    t0 = time.perf_counter()
    ids = manager.add_requests(prompts, max_new_tokens=1, record_timestamps=True)
    while manager.step():
        pass
    wall = time.perf_counter() - t0
    results = {}
    while (out := manager.get_result(timeout=0)) is not None:
        if out.is_finished():
            results[out.request_id] = out
    c = manager.engine.counters
    return {"wall_ms": 1e3 * wall,
            "ttft_ms": [1e3 * (results[i].timestamps[0] - t0) if results[i].timestamps else None for i in ids],
            "forwards": c["prefill_chunks"], "packed_forwards": c["packed_forwards"], "packed_rows": c["packed_rows"],
            "prefill_pads": c["prefill_pads"], "failed": c["failed"]}


def burst_level(args, models: dict, result: dict) -> None:
    """``--engine-burst N``: the engine's prefill of N chat-length prompts arriving together, with packing
    (``--burst-rows``) and without (1 row per forward), on each compiled system; interleaved repeats after one
    warm-up burst of each (the same prompts: the same shapes, so no compile is timed; counted anyway)."""
    budget = args.burst_budget
    out = {"prompts": args.engine_burst, "budget": budget, "rows": args.burst_rows,
           "max_tokens": args.burst_max_tokens, "repeats": args.repeats, "systems": {}}
    for system, model in models.items():
        if system == "stock" or "[" in system:
            continue
        prompts = burst_prompts(args.engine_burst, model.config.vocab_size, max_tokens=args.burst_max_tokens)
        out["prompt_tokens"] = sum(map(len, prompts))
        settings = {"packed": args.burst_rows, "one_row": 1}
        for rows in settings.values():  # warm-up: compiles, the chunk_kda captures
            engine_burst(model, prompts, budget, rows)
        graphs = _graphs(model)
        runs = {name: [] for name in settings}
        for _ in range(args.repeats):
            for name, rows in settings.items():
                runs[name].append(engine_burst(model, prompts, budget, rows))
        rec = {"graphs_compiled_in_timed_runs": _graphs(model) - graphs}
        for name, rs in runs.items():
            best = min(rs, key=lambda r: r["wall_ms"])
            ttft = sorted(t for t in best["ttft_ms"] if t is not None)
            rec[name] = {"wall_ms": [r["wall_ms"] for r in rs], "best_wall_ms": best["wall_ms"],
                         "median_wall_ms": statistics.median(r["wall_ms"] for r in rs),
                         "ttft_mean_ms": statistics.fmean(ttft), "ttft_p50_ms": ttft[len(ttft) // 2],
                         "ttft_max_ms": ttft[-1], **{k: best[k] for k in ("forwards", "packed_forwards",
                                                                         "packed_rows", "prefill_pads", "failed")}}
            print(f"burst {system} {name}: {args.engine_burst} prompts ({out['prompt_tokens']} tokens) in "
                  f"{best['wall_ms']:.1f} ms (median {rec[name]['median_wall_ms']:.1f}), TTFT mean "
                  f"{rec[name]['ttft_mean_ms']:.1f} / max {ttft[-1]:.1f} ms, {best['forwards']} forwards "
                  f"({best['packed_forwards']} packed)")
        rec["speedup_wall"] = rec["one_row"]["best_wall_ms"] / rec["packed"]["best_wall_ms"]
        rec["speedup_ttft_mean"] = rec["one_row"]["ttft_mean_ms"] / rec["packed"]["ttft_mean_ms"]
        out["systems"][system] = rec
    result["engine_burst"] = out


def model_level(args) -> dict:
    """Whole-model chunked prefills, three systems (module docstring); returns the JSON record."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = sorted(args.rows or MODEL_ROWS)
    max_seq_len = max(rows + ([args.burst_max_tokens] if args.engine_burst else [])) + 16
    start = time.perf_counter()
    ceiling = _matmul_ceiling(device, dtype)
    result = {
        "date": datetime.date.today().isoformat(), "model": args.model, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "dtype": str(dtype).removeprefix("torch."), "chunk": args.chunk, "max_seq_len": max_seq_len,
        "repeats": args.repeats, "matmul_ceiling_tflops": ceiling, "kda_prefill": kda_prefill_backend(),
        "batch": args.batch,
        # the switches an A/B run sets (UNIMEM_STAND_IN_MASKS, UNIMEM_KDA_GRAPHS, ...), as this process saw them
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith("UNIMEM_") or k == "TRITON_CACHE_AUTOTUNING"},
        "conditions": f"{args.batch} row(s) of random tokens, no padding, chunks of {args.chunk}, "
                      f"generate(max_new_tokens=1), "
                      f"best of {args.repeats} after a compiling warm-up; one max_seq_len for every row",
        "systems": {}, "rows": [],
    }
    import transformers

    result["transformers"] = transformers.__version__
    vocab = None
    models, warm = {}, {}  # warm: each system's untimed warm-up prompt (its own vocabulary)
    for system in args.systems:
        t = time.perf_counter()
        rows_cap = max(args.batch, args.burst_rows if args.engine_burst else 1)  # the burst packs that many rows
        model = _build(system, args.model, device, dtype, max_seq_len, args.backend, rows_cap)
        vocab = model.config.vocab_size
        warm[system] = torch.randint(3, vocab, (args.batch, warm_up_tokens(rows, args.chunk)),
                                     generator=torch.Generator().manual_seed(1)).to(device)
        _prefill(model, warm[system], args.chunk)  # compiles the first-chunk and the later-chunk graphs
        _sync(device)
        models[system] = model
        result["systems"][system] = {"build_and_warmup_s": time.perf_counter() - t, "graphs": _graphs(model),
                                     "rewrites": dict(model.unimem.rewrites) if system != "stock" else None}
        print(f"{system}: built and warmed up in {result['systems'][system]['build_and_warmup_s']:.1f} s")
    overrides = {}  # an --ab-env variant: the same compiled model, timed with the variables set
    for spec in args.ab_env:
        pairs = parse_ab_env(spec)
        for system in [s for s in models if s not in overrides]:
            variant = f"{system}[{spec}]"
            models[variant], overrides[variant] = models[system], pairs
            result["systems"][variant] = {**result["systems"][system], "environment": dict(pairs)}
            # a variable that changes the compiled path (UNIMEM_PREFILL_GRAPHS: static graphs, CUDA-graph
            # recordings on the second call) compiles and records here, not in a timed run
            t = time.perf_counter()
            with _overridden(pairs):
                for _ in range(2):
                    _prefill(models[system], warm[system], args.chunk)
            _sync(device)
            result["systems"][variant]["variant_warmup_s"] = time.perf_counter() - t
            print(f"{variant}: warmed up in {result['systems'][variant]['variant_warmup_s']:.1f} s")
    if args.engine_burst:
        burst_level(args, models, result)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(f"matmul ceiling {ceiling:.3g} TFLOP/s ({dtype}); max_seq_len {max_seq_len}")
    print(f"{'tokens':>7} {'system':>9} {'ms':>10} {'tokens/s':>10} {'x bound':>8} {'peak GiB':>9}")
    last: dict[str, tuple[int, float]] = {}
    for tokens in rows:
        flops = model_prefill_flops(next(iter(models.values())), tokens, args.chunk)
        if args.batch > 1:  # every row the same work: the bound scales with the rows
            flops = {k: v * args.batch if isinstance(v, (int, float)) else v for k, v in flops.items()}
        bound_ms = flops["total"] / ceiling / 1e9
        entry = {"tokens": tokens, "flops": flops, "bound_ms": bound_ms, "systems": {}}
        ids = torch.randint(3, vocab, (args.batch, tokens), generator=torch.Generator().manual_seed(tokens)).to(device)
        first_tokens = {}
        timed = {}  # system -> [times], graphs before; the systems' runs interleave (run r of each, then r + 1)
        for system in models:
            if system in last:  # attention is quadratic: scale the last measured run by the squared length
                seen, ms = last[system]
                estimate = ms / 1e3 * (tokens / seen) ** 2 * args.repeats
                if time.perf_counter() - start + estimate > args.deadline_s:
                    entry["systems"][system] = {"skipped": f"would pass --deadline-s (estimate {estimate:.0f} s)"}
                    print(f"{tokens:>7} {system:>9} skipped: estimate {estimate:.0f} s passes the deadline")
                    continue
            timed[system] = ([], _graphs(models[system]), {"peak": 0})
        outs = {}
        jit = {system: [] for system in timed}  # Triton compiles per timed run (a JIT in a run confounds it)
        for _ in range(args.repeats):
            for system, (times, _, peak) in list(timed.items()):
                try:
                    with _overridden(overrides.get(system)), _triton_compiles() as compiles:
                        if device.type == "cuda":
                            torch.cuda.reset_peak_memory_stats(device)
                            before = torch.cuda.memory_allocated(device)
                        _sync(device)
                        t = time.perf_counter()
                        outs[system] = _prefill(models[system], ids, args.chunk)
                        _sync(device)
                        times.append((time.perf_counter() - t) * 1e3)
                        if device.type == "cuda":
                            peak["peak"] = max(peak["peak"], torch.cuda.max_memory_allocated(device) - before)
                    jit[system].append(len(compiles.names) if compiles.available else None)
                except torch.OutOfMemoryError as e:
                    entry["systems"][system] = {"error": f"OutOfMemoryError: {str(e).splitlines()[0]}"}
                    print(f"{tokens:>7} {system:>9} out of memory")
                    del timed[system]
                    torch.cuda.empty_cache()
        for system, (times, graphs, peak) in timed.items():
            model = models[system]
            ms = min(times)
            last[system] = (tokens, ms)
            first_tokens[system] = int(outs[system][0, -1])
            rec = {"prefill_ms": ms, "median_ms": statistics.median(times),
                   "prefill_tokens_per_s": args.batch * tokens / ms * 1e3, "x_of_bound": ms / bound_ms,
                   "runs_ms": times, "graphs_compiled_in_timed_runs": (None if graphs is None
                                                                     else _graphs(model) - graphs),
                   "triton_compiles_per_run": jit[system]}
            if device.type == "cuda":
                rec["peak_bytes_above_start"] = peak["peak"]
            if args.profile_row == tokens:  # one more prefill under the profiler, after the timed ones
                with _overridden(overrides.get(system)):
                    rec["profile"] = kernel_breakdown(lambda: _prefill(model, ids, args.chunk), device)
                    rec["profile"]["host_stacks"] = host_stacks(lambda: _prefill(model, ids, args.chunk))
            entry["systems"][system] = rec
            peak = rec.get("peak_bytes_above_start")
            print(f"{tokens:>7} {system:>9} {ms:>10.1f} {rec['prefill_tokens_per_s']:>10.0f} {rec['x_of_bound']:>8.2f} "
                  + (f"{peak / 2**30:>9.2f}" if peak is not None else f"{'-':>9}")
                  + f"  median {rec['median_ms']:.1f}"
                  + ("" if not any(jit[system]) else f"  Triton compiles per run {jit[system]}"))
        if "stock" in first_tokens:
            entry["first_token_equal_to_stock"] = {s: t == first_tokens["stock"] for s, t in first_tokens.items()}
        done = entry["systems"]
        for other in ("old_path", "stock"):
            if "prefill_ms" in done.get("unimem", {}) and "prefill_ms" in done.get(other, {}):
                entry[f"unimem_speedup_over_{other}"] = done[other]["prefill_ms"] / done["unimem"]["prefill_ms"]
        result["rows"].append(entry)
        for system, rec in entry["systems"].items():
            if "profile" in rec:
                prof = rec["profile"]
                parts = ", ".join(f"{c} {v['ms']:.1f} ms ({v['fraction']:.0%})" for c, v in prof["by_category"].items())
                print(f"{tokens:>7} {system:>9} profile: {prof['kernel_ms']:.1f} ms of kernels in {prof['wall_ms']:.1f} "
                      f"ms (busy {prof['busy_fraction']:.0%}): {parts}")
                if "host" in prof:
                    h = prof["host"]
                    names = ", ".join(f"{e['name'][:40]} {e['ms']:.1f} ms x{e['calls']}" for e in h["top"][:8])
                    print(f"{tokens:>7} {system:>9} host: {h['launches']} launches {h['launch_ms']:.1f} ms, "
                          f"{h['blocking_calls']} blocking calls {h['blocking_ms']:.1f} ms, other {h['other_ms']:.1f} "
                          f"ms, untraced {h['untraced_ms']:.1f} ms; top: {names}")
                for op in prof.get("host_stacks", []):
                    print(f"{tokens:>7} {system:>9} host stack: {op['name'][:50]} {op['ms']:.1f} ms x{op['calls']}")
                    for st in op["stacks"]:
                        print(f"{'':>18}{st['ms']:.1f} ms x{st['calls']}: " + " <- ".join(st["frames"][:6]))
        print(f"{tokens:>7} bound {bound_ms:.1f} ms ({flops['total'] / 1e12:.2f} TFLOP; re-expansion in mla_prefill "
              f"{flops['reexpansion_flops'] / 1e12:.2f} TFLOP more)")
        if args.out:  # rewritten after every row: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="rows of 4k and 32k only")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tiles and workspace sizes")
    ap.add_argument("--short", action="store_true", help="only short chunks (16, 64, 256 queries) over 32k of "
                    "history, split-K off, by the rule and forced (short_chunks)")
    ap.add_argument("--workspace", type=int, default=mp.WORKSPACE_TOKENS, help="workspace_tokens of the op")
    ap.add_argument("--model", default=None, help="model level: a preset of unimem_compile.hf.models "
                    "(kimi-linear-48b-4l: the real geometry, 4 layers)")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="model level: row lengths in tokens")
    ap.add_argument("--chunk", type=int, default=CHUNK, help="model level: prefill_chunk_size")
    ap.add_argument("--batch", type=int, default=1, help="model level: rows prefilled together (each of the row "
                    "length; tokens/s and the bound count every row)")
    ap.add_argument("--ab-env", action="append", default=[], metavar="NAME=VALUE[+NAME=VALUE]",
                    help="model level: also time every system with the environment variable NAME set to "
                         "VALUE (the same model, warmed up twice with it, its runs interleaved with the system's), "
                         "e.g. UNIMEM_STAND_IN_MASKS=0; several variables at once joined by +; repeat the option "
                         "for more variants")
    ap.add_argument("--engine-burst", type=int, default=0, metavar="N",
                    help="model level: first time the continuous-batching engine's prefill of N chat-length prompts "
                         "(64..--burst-max-tokens tokens) submitted together, packed (--burst-rows) and one per "
                         "forward")
    ap.add_argument("--burst-rows", type=int, default=8, help="model level: max_prefill_rows of the packed burst")
    ap.add_argument("--burst-budget", type=int, default=4096, help="model level: max_prefill_tokens of the burst")
    ap.add_argument("--burst-max-tokens", type=int, default=2048, help="model level: the burst's longest prompt")
    ap.add_argument("--device", default="cuda", help="model level: cuda or cpu")
    ap.add_argument("--backend", default="inductor", help="model level: the inner torch.compile backend")
    ap.add_argument("--repeats", type=int, default=2, help="model level: timed runs per row and system (best)")
    ap.add_argument("--systems", default=",".join(MODEL_SYSTEMS), help="model level: comma-separated systems")
    ap.add_argument("--profile-row", type=int, default=None,
                    help="model level: after timing this row (tokens, one of --rows), prefill it once more under "
                         "torch.profiler and record where the time goes (kernel_breakdown)")
    ap.add_argument("--deadline-s", type=float, default=float("inf"),
                    help="model level: skip a row / system whose estimate would pass this many seconds")
    args = ap.parse_args(argv)
    if args.model is not None:
        args.systems = [s for s in args.systems.split(",") if s]
        unknown = sorted(set(args.systems) - set(MODEL_SYSTEMS))
        if unknown or not args.systems:
            ap.error(f"unknown --systems {unknown}; choose from {list(MODEL_SYSTEMS)}")
        if args.batch < 1:
            ap.error(f"--batch must be >= 1, got {args.batch}")
        if args.profile_row is not None and args.profile_row not in (args.rows or MODEL_ROWS):
            ap.error(f"--profile-row {args.profile_row} is not one of the rows {sorted(args.rows or MODEL_ROWS)}")
        for spec in args.ab_env:
            try:
                parse_ab_env(spec)
            except ValueError as e:
                ap.error(str(e))
        if args.repeats < 1 or args.chunk < 1:
            ap.error(f"--repeats and --chunk must be >= 1, got {args.repeats} and {args.chunk}")
        model_level(args)
        return 0
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
    if args.short:
        result["short"] = short_chunks(ceiling, args.workspace)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    print(f"{'row':>7} {'kv_len':>7} {'ms':>9} {'TFLOP/s':>7} {'of mm':>6} {'sdpa ms':>9} {'sync ms':>9}")
    for tokens in ([4096, 32768] if args.quick else [4096, 32768, 131072]):
        result["rows"].append(run_row(tokens, args.workspace, ceiling, sync=tokens == 32768))
        torch.cuda.empty_cache()
    if args.sweep:
        result["sweep"] = sweep(ceiling)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
