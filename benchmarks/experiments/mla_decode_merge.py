"""Issue 4: the vectorised merge vs the old per-split loop; stage-1-only time; bf16 partials; split counts."""
import sys, os, json, time
sys.path.insert(0, "benchmarks")
import torch, triton, triton.language as tl
from bench_mla_decode import H, R, Setup, bench_graph, effective_bytes, md, read_ceiling_tbs
OUT = os.environ.get("OUT", "/tmp")
t0 = time.time()
res = {"ceiling": read_ceiling_tbs()}
print("ceiling", res["ceiling"], flush=True)

@triton.jit
def old_merge(part_o_ptr, part_lse_ptr, kv_len_ptr, out_ptr, max_tokens, H, num_splits,
              R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n, split_len, _start, _end = md._split_bounds(kv_len_ptr, b, 0, num_splits, max_tokens, BLOCK_N)
    used = tl.cdiv(n, tl.maximum(split_len, 1))
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    m = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for s in range(0, used):
        slot = (b.to(tl.int64) * num_splits + s) * H + h
        lse = tl.load(part_lse_ptr + slot)
        o = tl.load(part_o_ptr + slot * R + offs_r, mask=r_ok, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, lse)
        scale = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * scale + w * o
        den = den * scale + w
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + (b.to(tl.int64) * H + h) * R + offs_r, out.to(out_ptr.dtype.element_ty), mask=r_ok)

REAL = md._mla_decode_merge_kernel
class Swap:
    def __init__(self, kernel=None, warps=None, bs=None):
        self.kernel, self.warps, self.bs = kernel, warps, bs
    def __getitem__(self, grid):
        if self.kernel is None:
            return lambda *a, **kw: None
        def go(*a, **kw):
            if self.warps: kw["num_warps"] = self.warps
            if self.bs: kw["BLOCK_S"] = self.bs
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
        got = md.mla_decode_triton(*a, num_splits=sp, partial_dtype=pdt).float()
        md._mla_decode_merge_kernel = Swap(old_merge)
        old = md.mla_decode_triton(*a, num_splits=sp, partial_dtype=pdt).float()
        md._mla_decode_merge_kernel = REAL
        print("check", sp, pdt, "vs ref", float((got - want).abs().max()), "vs old", float((got - old).abs().max()), flush=True)

variants = {"new": Swap(REAL), "old": Swap(old_merge), "stage1_only": Swap(None),
            "new_bs4": Swap(REAL, bs=4), "new_w8": Swap(REAL, warps=8), "new_w2": Swap(REAL, warps=2)}
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
    md._mla_decode_merge_kernel = REAL
    if c == 4096 and b <= 128:
        for sp in (2, 3, 4, 5, 6, 8, 12):
            if sp == splits: continue
            ms = bench_graph(lambda: md.mla_decode_triton(*a, num_splits=sp)); row[f"new_f32_sp{sp}"] = round(eb / ms / 1e9, 4)
            ms = bench_graph(lambda: md.mla_decode_triton(*a, num_splits=sp, partial_dtype=torch.bfloat16)); row[f"new_bf16_sp{sp}"] = round(eb / ms / 1e9, 4)
    res[f"{b}x{c}"] = row
    print(f"{b}x{c}", row, f"{time.time()-t0:.0f}s", flush=True)
    json.dump(res, open(f"{OUT}/merge2.json", "w"), indent=1)
