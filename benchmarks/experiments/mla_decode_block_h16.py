"""Issue 4 diag: merge-kernel share at 64x4k, block_h 16 variants, grouped merge."""
import sys, os, json, time
sys.path.insert(0, "benchmarks")
import torch, triton, triton.language as tl
from bench_mla_decode import H, R, Setup, bench_graph, effective_bytes, md, read_ceiling_tbs
OUT = os.environ.get("OUT", "/tmp")
t0 = time.time()
res = {"ceiling": read_ceiling_tbs()}
print("ceiling", res["ceiling"], flush=True)

@triton.jit
def merge_grouped(part_o_ptr, part_lse_ptr, kv_len_ptr, out_ptr, max_tokens, H, num_splits,
                  R: tl.constexpr, HG: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    n, split_len, _s, _e = md._split_bounds(kv_len_ptr, b, 0, num_splits, max_tokens, BLOCK_N)
    used = tl.cdiv(n, tl.maximum(split_len, 1))
    offs_h = g * HG + tl.arange(0, HG)
    offs_r = tl.arange(0, R)
    m = tl.full([HG], float("-inf"), tl.float32)
    den = tl.zeros([HG], tl.float32)
    acc = tl.zeros([HG, R], tl.float32)
    for s in range(0, used):
        slot = (b.to(tl.int64) * num_splits + s) * H + offs_h
        lse = tl.load(part_lse_ptr + slot)
        o = tl.load(part_o_ptr + slot[:, None] * R + offs_r[None, :]).to(tl.float32)
        m_new = tl.maximum(m, lse)
        sc = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * sc[:, None] + w[:, None] * o
        den = den * sc + w
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + (b.to(tl.int64) * H + offs_h[:, None]) * R + offs_r[None, :], out.to(out_ptr.dtype.element_ty))

shapes = [(64, 4096), (128, 4096), (64, 16384), (32, 4096), (256, 4096)]
setup = Setup(max(b * c for b, c in shapes))
sm = 192 ** -0.5
# correctness of block_h 16 variants and grouped merge
qn, qr, pt, kl = setup.inputs(4, 4096)
kl.copy_(torch.tensor([1, 100, 2049, 4096], dtype=torch.int32))
a = setup.args(qn, qr, pt, kl, sm)
want = md.mla_decode_reference(*a).float()
for w in (2, 4):
    for bn in (64, 32):
        for st in (2, 3):
            for sp in (1, 5):
                try:
                    got = md.mla_decode_triton(*a, block_h=16, block_n=bn, num_warps=w, num_stages=st, num_splits=sp).float()
                    print("check bh16", w, bn, st, sp, float((got - want).abs().max()), flush=True)
                except Exception as e:
                    print("FAIL", w, bn, st, sp, repr(e)[:300], flush=True)

def merge_only(B, splits, part_o, part_lse, kl, out, grouped=0):
    if grouped:
        merge_grouped[(B, H // grouped)](part_o, part_lse, kl, out, 1 << 30, H, splits, R=R, HG=grouped, BLOCK_N=64, num_warps=4)
    else:
        md._mla_decode_merge_kernel[(B, H)](part_o, part_lse, kl, out, 1 << 30, H, splits, R=R, BLOCK_R=512, BLOCK_N=64, num_warps=4)

for b, c in shapes:
    qn, qr, pt, kl = setup.inputs(b, c)
    a = setup.args(qn, qr, pt, kl, sm)
    eb = effective_bytes(b, c)
    row = {}
    ms = bench_graph(lambda: md.mla_decode_triton(*a)); row["default"] = (eb / ms / 1e9, ms * 1e3)
    splits = md.mla_decode_num_splits(b, pt.shape[1], H, 64, qn.device)
    row["splits_default"] = splits
    po = torch.randn(b, splits, H, R, device="cuda"); pl = torch.randn(b, splits, H, device="cuda")
    out = torch.empty(b, H, R, dtype=torch.bfloat16, device="cuda")
    # merge kernels alone (kv_len full so all splits used)
    for gname, gv in (("merge_bh", 0), ("merge_g8", 8), ("merge_g4", 4), ("merge_g16", 16)):
        try:
            ms = bench_graph(lambda: merge_only(b, splits, po, pl, kl, out, gv)); row[gname + "_us"] = ms * 1e3
        except Exception as e:
            row[gname + "_us"] = repr(e)[:200]
    # correctness of grouped merge vs default merge
    o1 = out.clone(); merge_only(b, splits, po, pl, kl, o1, 0); o2 = out.clone(); merge_only(b, splits, po, pl, kl, o2, 8)
    row["grouped_vs_bh_maxdiff"] = float((o1.float() - o2.float()).abs().max())
    for w in (2, 4):
        for bn, st in ((64, 2), (32, 2), (32, 3), (64, 3)):
            best = (0, 0)
            for sp in (1, 2, 3, 4, 6, 8):
                if b * sp * 2 > 132 * 8: continue
                try:
                    ms = bench_graph(lambda: md.mla_decode_triton(*a, block_h=16, block_n=bn, num_warps=w, num_stages=st, num_splits=sp))
                except Exception as e:
                    row[f"bh16_w{w}_bn{bn}_st{st}_sp{sp}"] = repr(e)[:100]; continue
                v = eb / ms / 1e9
                row[f"bh16_w{w}_bn{bn}_st{st}_sp{sp}"] = v
                best = max(best, (v, sp))
            print(f"{b}x{c} bh16 w{w} bn{bn} st{st} best {best[0]:.3f} at splits {best[1]}", flush=True)
    res[f"{b}x{c}"] = row
    print(f"{b}x{c}", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if not k.startswith("bh16")}, f"{time.time()-t0:.0f}s", flush=True)
    json.dump(res, open(f"{OUT}/bh16.json", "w"), indent=1)
# compiled resources of bh16 variants
try:
    for caches in md._mla_decode_split_kernel.device_caches.values():
        for k in caches[0].values():
            print("kernel", k.n_regs, k.n_spills, k.metadata.shared, k.metadata.num_warps, flush=True)
except Exception as e:
    print("res err", e)
