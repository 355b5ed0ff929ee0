"""Issue 4: how the L2 flush of the timing loop affects short kernels (do_bench zero-fill flush leaves L2 dirty)."""
import sys, os, json, time
sys.path.insert(0, "benchmarks")
import torch, triton
from bench_mla_decode import H, R, Setup, bench_graph, effective_bytes, md, read_ceiling_tbs, _read_kernel
OUT = os.environ.get("OUT", "/tmp")
res = {"ceiling_4g": read_ceiling_tbs()}
print("ceiling", res["ceiling_4g"], flush=True)
flush_buf = torch.empty(512 * 2**20 // 4, dtype=torch.int32, device="cuda").random_()
sink = torch.empty(8192, dtype=torch.int32, device="cuda")
sms = torch.cuda.get_device_properties(0).multi_processor_count

def read_flush():
    _read_kernel[(sms * 8,)](flush_buf, sink, flush_buf.numel(), BLOCK=4096, num_warps=8)

def zero_flush():
    flush_buf.zero_()

def timed(graph, flush, n=100):
    ts = []
    for i in range(n + 10):
        if flush: flush()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); graph.replay(); e.record()
        torch.cuda.synchronize()
        if i >= 10: ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts) // 2]

def graph_of(fn):
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side): fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    return g

shapes = [(64, 4096), (128, 4096), (64, 16384), (32, 4096), (256, 4096), (64, 1024)]
setup = Setup(max(b * c for b, c in shapes))
sm = 192 ** -0.5
for b, c in shapes:
    qn, qr, pt, kl = setup.inputs(b, c)
    a = setup.args(qn, qr, pt, kl, sm)
    eb = effective_bytes(b, c)
    x = torch.empty(eb // 4, dtype=torch.int32, device="cuda").random_()
    out = torch.empty(sms * 8, dtype=torch.int32, device="cuda")
    row = {}
    for name, fn in (("mla_decode", lambda: md.mla_decode_triton(*a)),
                     ("mla_decode_bf16p", lambda: md.mla_decode_triton(*a, partial_dtype=torch.bfloat16)),
                     ("read_same_bytes", lambda: _read_kernel[(sms * 8,)](x, out, x.numel(), BLOCK=4096, num_warps=8))):
        g = graph_of(fn)
        row[name] = {"do_bench": eb / triton.testing.do_bench(g.replay, warmup=25, rep=100) / 1e9,
                     "zero_flush": eb / timed(g, zero_flush) / 1e9,
                     "read_flush": eb / timed(g, read_flush) / 1e9,
                     "no_flush": eb / timed(g, None) / 1e9}
        del g
    del x
    res[f"{b}x{c}"] = row
    print(f"{b}x{c}", json.dumps({k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in row.items()}), flush=True)
json.dump(res, open(f"{OUT}/flush.json", "w"), indent=1)
