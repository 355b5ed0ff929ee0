"""One process of tests/gpu/test_runner_isolation_gpu.py (run as a script: a fault poisons its CUDA context,
not the test session's). Prints ``OK`` and exits 0 when every replay after the other graph's death gave the
reference result; a CUDA fault ends it with a traceback and a non-zero status.

usage: python runner_isolation_script.py {torch,models} {guarded,unguarded}

- ``torch``: two CUDA graphs of one split-K GEMM each, captured one after the other on
  ``torch.cuda.graph``'s process-wide capture stream, each in a pool of its own; the first is destroyed,
  the cuBLAS workspaces are cleared (as Inductor's CUDA graph trees do around every recording) and the
  allocator's cache emptied; then the second replays and its output is compared with an eager matmul.
- ``models``: the order of test_state_passes_gpu.py then test_runner_gpu.py: a tiny Kimi-Linear compiled
  with Inductor (CUDA graphs at their default), generated through the runner (the process's first
  capture) and kept; a second one at the runner tests' geometry, whose runner call captures bucket 4; the
  first model deleted and collected, ``torch.cuda.empty_cache()``; then the runner/fallback mix of
  ``test_a_fallback_call_and_runner_calls_mix`` (runner, transformers' loop under Inductor's CUDA graphs,
  runner), each call's tokens compared with stock transformers'.

``unguarded`` replaces ``decode._own_blas_workspace`` and ``decode._clear_blas_workspaces`` by no-ops: the
runner's captures as they were before the fix (the workspace cached by the first capture is shared).
"""

import contextlib
import gc
import sys

import torch


def _unguard() -> None:
    from unimem_compile.runner import decode

    decode._own_blas_workspace = contextlib.nullcontext
    decode._clear_blas_workspaces = lambda: None


def _capture_gemm(a, b, out, guarded):
    from unimem_compile.runner.decode import _own_blas_workspace

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as the runner's
        torch.mm(a, b, out=out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    guard = _own_blas_workspace() if guarded else contextlib.nullcontext()
    with guard, torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
        torch.mm(a, b, out=out)
    return graph


def torch_scenario(guarded: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    # M, N small and K long: cuBLAS splits K and reduces the partial products in its workspace
    shapes = [(16, 65536, 16), (64, 32768, 48)]
    first = [(torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16),
              torch.randn(k, n, device="cuda", generator=g, dtype=torch.bfloat16)) for m, k, n in shapes]
    outs1 = [torch.empty(a.shape[0], b.shape[1], device="cuda", dtype=a.dtype) for a, b in first]
    graphs1 = [_capture_gemm(a, b, o, guarded) for (a, b), o in zip(first, outs1)]
    for graph in graphs1:
        graph.replay()
    second = [(torch.randn_like(a), torch.randn_like(b)) for a, b in first]
    outs2 = [torch.empty_like(o) for o in outs1]
    graphs2 = [_capture_gemm(a, b, o, guarded) for (a, b), o in zip(second, outs2)]
    del graphs1, outs1, first
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 22,), 7.0, device="cuda") for _ in range(8)]  # reuse what was freed
    for graph in graphs2:
        graph.replay()
    torch.cuda.synchronize()
    del junk
    for (a, b), o in zip(second, outs2):
        want = (a.float() @ b.float())
        err = (o.float() - want).abs().max().item()
        scale = want.abs().max().item()
        assert err <= 2e-2 * scale, f"replayed GEMM off by {err} (scale {scale})"


def models_scenario() -> None:
    import unimem_compile
    from transformers import LogitsProcessor
    from unimem_compile.hf.models import build_model

    from tests.prompts import left_padded  # the repository root is on PYTHONPATH (the test puts it there)

    torch.backends.cuda.matmul.allow_tf32 = False

    def generate(model, ids, mask, **kw):
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, **kw)

    def prompts(lengths, seed, vocab=1024):
        ids, mask = left_padded(lengths, torch.Generator().manual_seed(seed), vocab)
        return ids.cuda(), mask.cuda()

    # test_state_passes_gpu.py's tiny fixture: Inductor, CUDA graphs on, the first capture of the process
    dead = build_model("kimi-linear-tiny", dtype=torch.float32, device="cuda")
    unimem_compile.compile(dead, max_batch_size=2, max_seq_len=24, page_size=8, backend="inductor")
    ids, mask = prompts([9, 6], 3)
    generate(dead, ids, mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert dead.unimem.runner_stats()["steps"][0]["captured"], dead.unimem.runner_stats()

    # test_runner_gpu.py's kimi pair
    stock = build_model("kimi-linear-tiny").cuda()
    model = build_model("kimi-linear-tiny").cuda()
    unimem_compile.compile(model, max_batch_size=6, max_seq_len=96, page_size=16)
    ids, mask = prompts([10, 6, 14], 5)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(generate(model, ids, mask, logits_processor=[], **kw),
                       generate(stock, ids, mask, logits_processor=[], **kw))  # captures bucket 4

    del dead  # the module teardown of test_state_passes_gpu.py, collected now instead of whenever
    gc.collect()
    torch.cuda.empty_cache()

    class Ban5(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 5] = -float("inf")
            return scores

    for processors in ([], [Ban5()], []):  # runner, transformers' loop (cudagraph trees), runner
        want = generate(stock, ids, mask, logits_processor=processors, **kw)
        got = generate(model, ids, mask, logits_processor=processors, **kw)
        torch.cuda.synchronize()
        assert torch.equal(got, want), (processors, got, want)
    steps = {(s["bucket"], s["sampling"]): s for s in model.unimem.runner_stats()["steps"]}
    assert steps[(4, False)]["captured"] and steps[(4, False)]["steps"] == 3 * 7, steps


def main(argv: list[str]) -> None:
    scenario, mode = argv
    if mode not in ("guarded", "unguarded") or scenario not in ("torch", "models"):
        raise SystemExit(f"usage: {sys.argv[0]} {{torch,models}} {{guarded,unguarded}}, got {argv}")
    if mode == "unguarded":
        _unguard()
    if scenario == "torch":
        torch_scenario(mode == "guarded")
    else:
        models_scenario()
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1:])
