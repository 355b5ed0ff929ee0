"""bench_mla_prefill's profile breakdown (``--profile-row``): the categories and the sums they promise."""

import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("_bench_mla_prefill_profile",
                                                  os.path.join(ROOT, "benchmarks", "bench_mla_prefill.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, category", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("triton_tem_fused_mm_3", "matmul"),
    ("aten::addmm", "matmul"),
    ("aten::_grouped_mm", "matmul"),
    ("_mla_prefill_attn_kernel", "mla_attention"),
    ("_mla_kv_write_kernel", "mla_cache"),
    ("_mla_gather_kernel", "mla_cache"),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "kda"),
    ("l2norm_fwd_kernel", "kda"),
    ("causal_conv1d_fwd_kernel", "conv"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "moe_routing"),
    ("triton_poi_fused_add_mul_silu_7", "inductor_fused"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
])
def test_profile_categories_of_real_kernel_names(name, category):
    assert _bench().profile_category(name) == category


def test_kernel_breakdown_on_the_cpu_adds_up_and_ranks():
    bench = _bench()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
    x = torch.randn(1, 4, 512, generator=g)
    w = torch.randn(4, 1, 3, generator=g)

    def fn():
        y = a @ b
        torch.nn.functional.conv1d(x, w, groups=4)
        return torch.topk(y, 4).values

    fn()
    prof = bench.kernel_breakdown(fn, torch.device("cpu"), top=5)
    cats = prof["by_category"]
    assert {"matmul", "conv", "moe_routing"} <= set(cats)
    assert sum(c["ms"] for c in cats.values()) == pytest.approx(prof["kernel_ms"], rel=1e-9)
    assert sum(c["fraction"] for c in cats.values()) == pytest.approx(1.0, rel=1e-9)
    assert [c["ms"] for c in cats.values()] == sorted((c["ms"] for c in cats.values()), reverse=True)
    tops = [t["ms"] for t in prof["top"]]
    assert 0 < len(tops) <= 5 and tops == sorted(tops, reverse=True)
    assert all(t["category"] == bench.profile_category(t["name"]) for t in prof["top"])
    assert prof["wall_ms"] > 0 and prof["busy_fraction"] == prof["kernel_ms"] / prof["wall_ms"]


def test_profile_row_must_be_one_of_the_rows(capsys):
    with pytest.raises(SystemExit) as e:
        _bench().main(["--model", "kimi-linear-tiny", "--device", "cpu", "--rows", "40", "--profile-row", "64"])
    assert e.value.code == 2 and "--profile-row 64 is not one of the rows [40]" in capsys.readouterr().err


def test_host_summary_sorts_runtime_calls_into_launches_blocking_and_the_rest():
    """host_summary: exact counts and sums from synthetic CPU events; the four parts add up to the wall."""
    bench = _bench()
    events = [("cudaLaunchKernel", 3.25, 300), ("cuLaunchKernelEx", 0.75, 40), ("cudaStreamSynchronize", 7.5, 2),
              ("cudaMemcpyAsync", 1.5, 9), ("aten::empty_strided", 2.0, 120), ("aten::mm", 1.0, 30),
              ("cudaMemcpyToSymbol", 0.25, 1)]
    h = bench.host_summary(events, wall_ms=20.0, top=3)
    assert (h["launches"], h["blocking_calls"]) == (340, 11)
    assert h["launch_ms"] == pytest.approx(4.0) and h["blocking_ms"] == pytest.approx(9.0)
    assert h["other_ms"] == pytest.approx(3.25) and h["untraced_ms"] == pytest.approx(3.75)
    assert h["launch_ms"] + h["blocking_ms"] + h["other_ms"] + h["untraced_ms"] == pytest.approx(20.0)
    assert [e["name"] for e in h["top"]] == ["cudaStreamSynchronize", "cudaLaunchKernel", "aten::empty_strided"]
    assert bench.host_summary(events, wall_ms=1.0)["untraced_ms"] == 0.0


def _index_heavy(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    out = x
    for _ in range(7):
        out = out[idx]
    return out


def _mm_light(x: torch.Tensor) -> torch.Tensor:
    return x[:4] @ x[:, :4]


def test_host_stacks_names_the_python_frames_that_issue_each_operator():
    bench = _bench()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(512, 512, generator=gen)
    idx = torch.randint(0, 512, (512,), generator=gen)

    def call():
        _index_heavy(x, idx)
        _mm_light(x)

    ops = bench.host_stacks(call, top=10)
    by_name = {op["name"]: op for op in ops}
    assert by_name["aten::index"]["calls"] == 7  # exactly the seven indexings, none from elsewhere
    (stack,) = by_name["aten::index"]["stacks"]  # one call site
    assert stack["calls"] == 7 and stack["frames"][0].endswith("_index_heavy")
    assert "aten::mm" in by_name and by_name["aten::mm"]["stacks"][0]["frames"][0].endswith("_mm_light")
    assert abs(sum(s["ms"] for s in by_name["aten::index"]["stacks"]) - by_name["aten::index"]["ms"]) < 1e-9
    assert all(not op["name"].startswith(("cuda", "<built-in")) for op in ops)
    assert [op["ms"] for op in ops] == sorted((op["ms"] for op in ops), reverse=True)
