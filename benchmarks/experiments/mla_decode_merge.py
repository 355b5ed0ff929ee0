"""Issue 4: a tiled merge vs the library's per-split loop; stage-1-only time; bf16 partials; split counts."""
import sys, os, json, time
sys.path.insert(0, "benchmarks")
import torch, triton, triton.language as tl
from bench_mla_decode import H, R, Setup, bench_graph, effective_bytes, md, read_ceiling_tbs
OUT = os.environ.get("OUT", "/tmp")
t0 = time.time()
res = {"ceiling": read_ceiling_tbs()}
print("ceiling", res["ceiling"], flush=True)

# The library's merge kernel (ops/mla_decode.py) is the per-split loop ("old" below). The variant measured
# against it ("new"): the used splits read BLOCK_S at a time as one [BLOCK_S, R] tile, one memory round trip
# per chunk. Measured no faster (RESULTS.md, fourth session) and not kept.
@triton.jit
def tiled_merge(part_o_ptr, part_lse_ptr, kv_len_ptr, out_ptr, max_tokens, H, num_splits,
                R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n, split_len, _start, _end = md._split_bounds(kv_len_ptr, b, 0, num_splits, max_tokens, BLOCK_N)
    used = tl.cdiv(n, tl.maximum(split_len, 1))
    offs_r = tl.arange(0, BLOCK_R)
    offs_s = tl.arange(0, BLOCK_S)
    r_ok = offs_r < R
    m = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for s0 in range(0, used, BLOCK_S):
        s_ok = (s0 + offs_s) < used
        slot = (b.to(tl.int64) * num_splits + s0 + offs_s) * H + h
        lse = tl.load(part_lse_ptr + slot, mask=s_ok, other=float("-inf"))
        o = tl.load(part_o_ptr + slot[:, None] * R + offs_r[None, :], mask=s_ok[:, None] & r_ok[None, :],
                    other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(lse, 0))
        scale = tl.exp2(m - m_new)
        w = tl.where(s_ok, tl.exp2(lse - m_new), 0.0)
        acc = acc * scale + tl.sum(w[:, None] * o, 0)
        den = den * scale + tl.sum(w, 0)
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + (b.to(tl.int64) * H + h) * R + offs_r, out.to(out_ptr.dtype.element_ty), mask=r_ok)

REAL = md._mla_decode_merge_kernel
class Swap:
    """Stands in for the library's merge kernel: None launches nothing (stage 1 alone); the tiled variant
    gets BLOCK_S (default 8) and optionally another warp count."""
    def __init__(self, kernel=None, warps=None, bs=8):
        self.kernel, self.warps, self.bs = kernel, warps, bs
    def __getitem__(self, grid):
        if self.kernel is None:
            return lambda *a, **kw: None
        def go(*a, **kw):
            if self.warps: kw["num_warps"] = self.warps
            if self.kernel is tiled_merge: kw["BLOCK_S"] = self.bs
            return self.kernel[grid](*a, **kw)
        return go

shapes = [(64, 4096), (128, 4096), (64, 16384), (32, 4096), (256, 4096), (64, 8192), (128, 16384), (32, 16384)]
setup = Setup(max(b * c for b, c in shapes))
sm = 192 ** -0.5
qn, qr, pt, kl = setup.inputs(4, 4096)
kl.copy_(torch.tensor([1, 100, 2049, 4096], dtype=torch.int32))
a = setup.args(qn, qr, pt, kl, sm)
want = md.mla_decode_reference(*a).float()
for sp in (2, 5, 12, 40):
    for pdt in (torch.float32, torch.bfloat16):
        old = md.mla_decode_triton(*a, num_splits=sp, partial_dtype=pdt).float()
        md._mla_decode_merge_kernel = Swap(tiled_merge)
        got = md.mla_decode_triton(*a, num_splits=sp, partial_dtype=pdt).float()
        md._mla_decode_merge_kernel = REAL
        print("check", sp, pdt, "vs ref", float((got - want).abs().max()), "vs old", float((got - old).abs().max()), flush=True)

variants = {"new": Swap(tiled_merge), "old": Swap(REAL), "stage1_only": Swap(None),
            "new_bs4": Swap(tiled_merge, bs=4), "new_w8": Swap(tiled_merge, warps=8),
            "new_w2": Swap(tiled_merge, warps=2)}
for b, c in shapes:
    qn, qr, pt, kl = setup.inputs(b, c)
    a = setup.args(qn, qr, pt, kl, sm)
    eb = effective_bytes(b, c)
    splits = md.mla_decode_num_splits(b, pt.shape[1], H, 64, qn.device)
    row = {"splits_default": splits}
    for name, sw in variants.items():
        md._mla_decode_merge_kernel = sw
        for pname, pdt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
            if name not in ("new", "old", "stage1_only") and pname == "bf16":
                continue
            ms = bench_graph(lambda: md.mla_decode_triton(*a, partial_dtype=pdt))
            row[f"{name}_{pname}"] = (round(eb / ms / 1e9, 4), round(ms * 1e3, 2))
    md._mla_decode_merge_kernel = variants["new"]  # the split counts were swept with the tiled merge
    if c == 4096 and b <= 128:
        for sp in (2, 3, 4, 5, 6, 8, 12):
            if sp == splits: continue
            ms = bench_graph(lambda: md.mla_decode_triton(*a, num_splits=sp)); row[f"new_f32_sp{sp}"] = round(eb / ms / 1e9, 4)
            ms = bench_graph(lambda: md.mla_decode_triton(*a, num_splits=sp, partial_dtype=torch.bfloat16)); row[f"new_bf16_sp{sp}"] = round(eb / ms / 1e9, 4)
    md._mla_decode_merge_kernel = REAL
    res[f"{b}x{c}"] = row
    print(f"{b}x{c}", row, f"{time.time()-t0:.0f}s", flush=True)
    json.dump(res, open(f"{OUT}/merge2.json", "w"), indent=1)
