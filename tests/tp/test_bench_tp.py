"""benchmarks/bench_tp.py without a GPU: its ratios against the TP 1 record, and its deadline (the whole
GPU path runs on the CPU with ``--smoke``, by hand: about a minute per launch, too slow for CI)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("_bench_tp", ROOT / "benchmarks" / "bench_tp.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


def _record(tps, peak, capacity, tokens):
    return {"decode_tokens_per_s": tps, "tokens": tokens,
            "per_gpu": [{"peak_memory_bytes": peak, "capacity": {"arena_bytes": 1 << 30, **capacity}}]}


def test_ratios_against_tp1_per_gpu(bench):
    tp1 = _record(1000.0, 40 << 30, {"4096": 500, "131072": 30}, [[5, 6, 7, 8]])
    tp2 = _record(1500.0, 25 << 30, {"4096": 700, "131072": 31}, [[5, 6, 9, 8]])
    tp2["per_gpu"].append({"peak_memory_bytes": 26 << 30, "capacity": tp2["per_gpu"][0]["capacity"]})
    bench.add_ratios(tp2, tp1)
    assert tp2["ratios_vs_tp1"] == {"decode_tokens_per_s": 1.5, "peak_memory_per_gpu": 26 / 40,
                                    "capacity_4096_tokens_per_gpu": 700 / 500,
                                    "capacity_131072_tokens_per_gpu": 31 / 30}
    assert tp2["new_tokens_equal_to_tp1"] == 0.75
    alone = _record(1.0, None, {}, [[1]])
    bench.add_ratios(alone, None)
    assert "ratios_vs_tp1" not in alone


def test_deadline_stops_before_the_first_configuration(bench, tmp_path, capsys):
    out = tmp_path / "tp1.json"
    assert bench.main(["--smoke", "--out", str(out), "--deadline-s", "0"]) == 0
    assert "deadline: kimi-linear-tiny_b2_p24 would not finish in time" in capsys.readouterr().out
    assert not out.exists()  # nothing measured, nothing written


def test_without_cuda_it_asks_for_smoke(bench, capsys):
    if bench.torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real benchmark")
    assert bench.main(["--out", "/tmp/unused.json"]) == 2
    assert "use --smoke" in capsys.readouterr().err
