"""Issue 4: evict_first on the streamed KV loads; bf16 partials; repeated to see noise."""
import sys, os, json, importlib
sys.path.insert(0, "benchmarks")
import unimem_compile.ops as ops_pkg
src_path = os.path.join(os.path.dirname(ops_pkg.__file__), "mla_decode.py")
src = open(src_path).read()
patched = src.replace("c0_ok[None, :], other=0.0)", 'c0_ok[None, :], other=0.0, eviction_policy="evict_first")')
patched = patched.replace("c1_ok[None, :], other=0.0)", 'c1_ok[None, :], other=0.0, eviction_policy="evict_first")')
patched = patched.replace("cr_ok[None, :], other=0.0)", 'cr_ok[None, :], other=0.0, eviction_policy="evict_first")')
n = patched.count("evict_first"); print("patched loads", n)
patched = patched.replace('@torch.library.custom_op("unimem::mla_decode"', '@torch.library.custom_op("unimem::mla_decode_ev"')
open(os.path.join(os.path.dirname(ops_pkg.__file__), "mla_decode_ev.py"), "w").write(patched)
ev = importlib.import_module("unimem_compile.ops.mla_decode_ev")
import torch
from bench_mla_decode import H, R, Setup, bench_graph, effective_bytes, md, read_ceiling_tbs
OUT = os.environ.get("OUT", "/tmp")
res = {"ceiling": read_ceiling_tbs()}
shapes = [(64, 4096), (128, 4096), (64, 16384), (32, 4096), (256, 4096), (64, 8192)]
setup = Setup(max(b * c for b, c in shapes))
sm = 192 ** -0.5
qn, qr, pt, kl = setup.inputs(5, 4096)
kl.copy_(torch.tensor([1, 100, 2049, 4096, 0], dtype=torch.int32))
a = setup.args(qn, qr, pt, kl, sm)
want = md.mla_decode_reference(*a).float()
for sp in (1, 5):
    print("check ev", sp, float((ev.mla_decode_triton(*a, num_splits=sp).float() - want).abs().max()),
          "bf16p", float((md.mla_decode_triton(*a, num_splits=sp, partial_dtype=torch.bfloat16).float() - want).abs().max()), flush=True)
for b, c in shapes:
    qn, qr, pt, kl = setup.inputs(b, c)
    a = setup.args(qn, qr, pt, kl, sm)
    eb = effective_bytes(b, c)
    row = {k: [] for k in ("base", "bf16p", "ev", "ev_bf16p")}
    for rep in range(3):
        for k, fn in (("base", lambda: md.mla_decode_triton(*a)), ("bf16p", lambda: md.mla_decode_triton(*a, partial_dtype=torch.bfloat16)),
                      ("ev", lambda: ev.mla_decode_triton(*a)), ("ev_bf16p", lambda: ev.mla_decode_triton(*a, partial_dtype=torch.bfloat16))):
            row[k].append(round(eb / bench_graph(fn) / 1e9, 4))
    res[f"{b}x{c}"] = row
    print(f"{b}x{c}", row, flush=True)
json.dump(res, open(f"{OUT}/ev.json", "w"), indent=1)
