"""The benchmark scripts run end to end on the CPU: the generation benchmark's smoke mode (tiny model, all
four systems, resume and deadline; its profile parser on a synthetic trace) and the capacity benchmark's
quick mode (JSON, plots, targets)."""

import datetime
import importlib.util
import json
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script(name):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and the process pool look the module up by name
    spec.loader.exec_module(module)
    return module


def test_generate_smoke_records_all_four_systems_then_resumes_without_rerunning(tmp_path, capsys):
    bench = _script("bench_generate")
    out = tmp_path / "gen"
    bundle = tmp_path / "bundle.json"
    argv = ["--device", "cpu", "--smoke", "--configs", "kimi-linear-tiny_b2_p24"]
    assert bench.main(argv + ["--out", str(out), "--bundle", str(bundle), "--repeats", "2", "--profile"]) == 0
    rec = json.loads((out / "kimi-linear-tiny_b2_p24.json").read_text())
    assert rec["complete"] is True and set(rec["systems"]) == {"eager", "static", "unimem", "handloop"}
    assert rec["config"] == {"model": "kimi-linear-tiny", "batch": 2, "prompt": 24}
    assert rec["environment"]["fla"]["importable"] in (True, False)
    for name, s in rec["systems"].items():
        assert "error" not in s, (name, s.get("error"))
        assert s["new_tokens_generated"] == 4 and s["decode_steps"] == 3
        assert s["prefill_ms"] > 0 and s["decode_tokens_per_s"] > 0 and s["achieved_bandwidth_gbs"] > 0
    # fp32 greedy on the CPU: the four systems generate the same tokens
    for name in ("static", "unimem", "handloop"):
        assert rec["systems"][name]["new_tokens_equal_to_eager"] == 1.0, name
    unimem = rec["systems"]["unimem"]
    assert unimem["pool"]["kv_pages_used"] == 0  # generate() gave its pages back
    assert len(unimem["runs"]) == 2 and unimem["runner"]["steps"][0]["steps"] > 0  # the runner decoded
    assert unimem["profile"] == {"skipped": "needs CUDA (the kernels of the captured steps)"}
    ratio_keys = {f"decode_tokens_per_s_unimem/{o}" for o in ("eager", "static", "handloop")}
    assert ratio_keys <= set(rec["ratios"]) and ratio_keys <= set(rec["ratios"]["_rounds"])  # per-round medians
    table = capsys.readouterr().out
    assert "(c) unimem" in table and "kimi-linear-tiny_b2_p24" in table

    before = (out / "kimi-linear-tiny_b2_p24.json").read_text()
    assert json.loads(bundle.read_text()) == {"kimi-linear-tiny_b2_p24": rec}
    assert bench.main(argv + ["--out", str(out)]) == 0
    assert "recorded already, skipped" in capsys.readouterr().out
    assert (out / "kimi-linear-tiny_b2_p24.json").read_text() == before
    # a fresh folder seeded from the bundle (a new machine) resumes too
    fresh = tmp_path / "fresh"
    assert bench.main(argv + ["--out", str(fresh), "--resume-from", str(bundle)]) == 0
    assert "recorded already, skipped" in capsys.readouterr().out
    assert json.loads((fresh / "kimi-linear-tiny_b2_p24.json").read_text()) == rec


def test_generate_smoke_with_fp8_kv_records_the_fp8_system(tmp_path):
    bench = _script("bench_generate")
    out, bundle = tmp_path / "gen", tmp_path / "generate_fp8.json"
    assert bench.main(["--device", "cpu", "--smoke", "--configs", "kimi-linear-tiny_b2_p24", "--kv-dtype", "fp8_e4m3",
                       "--systems", "unimem_fp8", "--out", str(out), "--bundle", str(bundle)]) == 0
    rec = json.loads(bundle.read_text())["kimi-linear-tiny_b2_p24"]
    s = rec["systems"]["unimem_fp8"]
    assert "error" not in s and list(rec["systems"]) == ["unimem_fp8"] and rec["kv_dtype"] == "fp8_e4m3"
    assert s["kv_dtype"] == "float8_e4m3fn" and s["decode_tokens_per_s"] > 0 and s["decode_steps"] == 3
    assert s["pool"]["page_bytes"] == 64 * 2 * 112  # 2 MLA layers of scaled fp8 rows (64 + 4 + 32 -> 112 bytes)
    assert rec["complete"] is False  # (c) unimem, the bf16 row beside it, was not run


@pytest.mark.parametrize("argv, message", [
    (["--systems", "unimem_fp8"], "unknown --systems ['unimem_fp8']; choose from ['eager', 'static', 'unimem', "
                                  "'handloop'] "
                                  "(unimem_fp8 needs --kv-dtype)"),
    (["--new-tokens", "1"], "--new-tokens must be >= 2 (decode speed needs a decode step), got 1"),
    (["--new-tokens", "0"], "--new-tokens must be >= 2 (decode speed needs a decode step), got 0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--systems", "eager,foo"], "unknown --systems ['foo']; choose from ['eager', 'static', 'unimem', 'handloop']"),
])
def test_generate_refuses_arguments_it_would_silently_rewrite_or_ignore(tmp_path, capsys, argv, message):
    bench = _script("bench_generate")
    assert bench.main(["--device", "cpu", "--smoke", "--out", str(tmp_path / "gen"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "gen").exists()


def test_generate_does_not_resume_a_record_measured_under_other_conditions(tmp_path, capsys):
    bench = _script("bench_generate")
    out = tmp_path / "gen"
    out.mkdir()
    name = "kimi-linear-tiny_b2_p24"
    recorded = {"config": {"model": "kimi-linear-tiny", "batch": 2, "prompt": 24}, "new_tokens": 3, "dtype": "fp32",
                "systems": {"eager": {"system": "eager", "prefill_ms": 1.0, "decode_tokens_per_s": 10.0,
                                      "ms_per_step": 1.0, "achieved_bandwidth_gbs": 1.0}}}
    (out / f"{name}.json").write_text(json.dumps(recorded))
    argv = ["--device", "cpu", "--smoke", "--configs", name, "--out", str(out), "--systems", "unimem"]
    assert bench.main(argv + ["--new-tokens", "12"]) == 2
    assert "recorded under other conditions (new_tokens 3 there, 12 now)" in capsys.readouterr().out
    assert json.loads((out / f"{name}.json").read_text()) == recorded  # untouched
    # a record without a decode figure prints n/a instead of crashing the table
    recorded["systems"]["eager"]["decode_tokens_per_s"] = None
    (out / f"{name}.json").write_text(json.dumps(recorded))
    assert "n/a" in bench.format_table(str(out), [c for c in bench.SMOKE_CONFIGS if c.name == name])


def test_mla_decode_fp8_targets_and_file_names_of_record(tmp_path):
    bench = _script("bench_mla_decode")

    def pt(batch, context, speedup):
        return {"batch": batch, "context": context, "speedup_vs_bf16": speedup}

    got = bench.fp8_targets([pt(32, 4096, 1.1), pt(64, 16384, 1.7), pt(128, 16384, 1.4), pt(64, 4096, 0.9)])
    assert got == {"target": 1.6, "floor": 1.25, "issue_points": 2, "issue_points_min_speedup": 1.4,
                   "other_points_min_speedup": 0.9, "meets_target": False, "meets_floor": True,
                   "others_at_least_bf16": False}
    assert bench.fp8_targets([pt(32, 4096, 1.2)])["meets_floor"] is False  # no issue point: nothing met
    day = datetime.date.today().isoformat()
    assert bench.out_path(str(tmp_path), bench.torch.float8_e4m3fn, False).endswith(f"mla_decode_{day}_fp8.json")
    assert bench.out_path(str(tmp_path), bench.torch.float8_e4m3fn, True).endswith(f"mla_decode_{day}_l2_fp8.json")
    assert bench.out_path(str(tmp_path), bench.torch.bfloat16, True).endswith(f"mla_decode_{day}_l2.json")
    # an fp8 run of a kernel named on the command line sits beside the auto run; bf16 names are unchanged
    assert bench.out_path(str(tmp_path), bench.torch.float8_e4m3fn, False, "wgmma").endswith(
        f"mla_decode_{day}_fp8_wgmma.json")
    assert bench.out_path(str(tmp_path), bench.torch.float8_e4m3fn, True, "wgmma").endswith(
        f"mla_decode_{day}_l2_fp8_wgmma.json")
    assert bench.out_path(str(tmp_path), bench.torch.bfloat16, False, "wgmma").endswith(f"mla_decode_{day}.json")


def test_graph_kernel_time_counts_the_kernels_of_graph_replays_only():
    bench = _script("bench_generate")

    def runtime(name, corr):
        return {"cat": "cuda_runtime", "name": name, "ts": 0.0, "dur": 1.0, "args": {"correlation": corr}}

    def kernel(ts, dur, corr):
        return {"cat": "kernel", "name": "k", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = [runtime("cudaGraphLaunch", 1), runtime("cudaGraphLaunch_v10000", 2), runtime("cudaLaunchKernel", 3),
              kernel(10.0, 100.0, 1), kernel(60.0, 100.0, 1),  # overlapping: busy 150 us, summed 200 us
              kernel(500.0, 50.0, 2), kernel(900.0, 400.0, 3)]  # the last one is no replay's (a prefill kernel)
    got = bench.graph_kernel_time(events)
    assert got == {"replays": 2, "kernel_ms_per_step": 0.125, "busy_ms_per_step": 0.1, "kernels_per_step": 1.5}
    assert bench.graph_kernel_time([runtime("cudaLaunchKernel", 3), kernel(0.0, 5.0, 3)])["replays"] == 0


def test_generate_deadline_stops_before_starting_a_system(tmp_path, capsys):
    bench = _script("bench_generate")
    out = tmp_path / "gen"
    assert bench.main(["--device", "cpu", "--smoke", "--out", str(out), "--deadline-s", "0"]) == 0
    assert "deadline" in capsys.readouterr().out
    assert list(out.iterdir()) == []


def test_capacity_quick_run_writes_json_and_plots_and_never_refuses_with_room(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    bench = _script("bench_capacity")
    out = tmp_path / "cap.json"
    assert bench.main(["--quick", "--jobs", "1", "--out", str(out), "--plots", str(tmp_path)]) == 0
    report = json.loads(out.read_text())
    assert set(report["traces"]) == {"stationary", "phased"}
    for entry in report["traces"].values():
        assert entry["targets"]["unified_refused_with_room"] == 0
        assert entry["unified"]["finished"] == entry["trace"]["requests"] - entry["unified"]["rejected"]
        assert entry["ratio_mean_concurrent"]["unified/best_static"] > 0
    for png in ("capacity_occupancy.png", "capacity_comparison.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "unified / best static" in capsys.readouterr().out


def test_capacity_sensitivity_reproduces_the_benchmark_trace_and_reports_each_size(tmp_path, capsys):
    """--quick with n_long 3 is bench_capacity's quick phased trace: the same unified / best-static ratios,
    to the last bit (the same simulations); a larger long-context phase is reported as its own row."""
    pytest.importorskip("matplotlib")
    bench = _script("bench_capacity")
    cap = tmp_path / "cap.json"
    assert bench.main(["--quick", "--jobs", "1", "--out", str(cap), "--plots", str(tmp_path)]) == 0
    phased = json.loads(cap.read_text())["traces"]["phased"]
    sens = _script("capacity_sensitivity")
    out = tmp_path / "sens.json"
    assert sens.main(["--quick", "--jobs", "1", "--n-long", "3", "6", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"3", "6"}
    for metric in ("mean_concurrent", "mean_concurrent_loaded"):
        row = rows["3"][metric]
        assert row["ratio"] == phased[f"ratio_{metric}"]["unified/best_static"]
        assert row["best_kv_fraction"] == phased[f"ratio_{metric}"]["best_kv_fraction"]
        assert row["unified"] == phased["unified"][metric]
        assert rows["6"][metric]["ratio"] == rows["6"][metric]["unified"] / rows["6"][metric]["best_static"]
    assert "n_long    6" in capsys.readouterr().out


def test_capacity_best_static_split_when_every_split_rejects_some_requests():
    bench = _script("bench_capacity")
    splits = {0.3: {"rejected": 2, "mean_concurrent": 9.0}, 0.5: {"rejected": 1, "mean_concurrent": 5.0},
              0.7: {"rejected": 1, "mean_concurrent": 6.0}}
    assert bench._best(splits, "mean_concurrent") == (0.7, splits[0.7])  # fewest rejected, then the metric
    splits[0.3]["rejected"] = 0
    assert bench._best(splits, "mean_concurrent")[0] == 0.3  # a split serving the whole trace wins
    # a split the budget cannot build (None) is no candidate; one never under load (None) ranks last
    loaded = {0.2: None, 0.4: {"rejected": 0, "mean_concurrent_loaded": None},
              0.6: {"rejected": 0, "mean_concurrent_loaded": 3.0}}
    assert bench._best(loaded, "mean_concurrent_loaded")[0] == 0.6
    assert bench._ratio(5.0, None) is None and bench._ratio(None, 2.0) is None and bench._ratio(3.0, 2.0) == 1.5


@pytest.mark.parametrize("argv, message", [(["--reserve", "-0.5"], "--reserve must be in [0, 1)"),
                                           (["--reserve", "1"], "--reserve must be in [0, 1)"),
                                           (["--budget-gib", "inf"], "--budget-gib must be positive and finite"),
                                           (["--page-size", "0"], "--page-size must be >= 1"),
                                           (["--seed", "-1"], "--seed must be >= 0"),
                                           (["--budget-gib", "0.05"], "below the minimum"),
                                           (["--budget-gib", "0.09"], "cannot hold any static split of the grid")])
def test_capacity_refuses_bad_arguments_before_simulating(tmp_path, capsys, argv, message):
    bench = _script("bench_capacity")
    assert bench.main(["--quick", "--out", str(tmp_path / "c.json"), "--plots", str(tmp_path / "p"), *argv]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "c.json").exists()


def test_prefill_model_flops_count_every_matmul_once_as_documented():
    """kimi-linear-tiny (KDA, MLA, KDA, MLA; dense, MoE, dense, MoE), 100 tokens in chunks of 32, by hand."""
    from unimem_compile.hf.models import build_model

    bench = _script("bench_mla_prefill")
    kda = 3 * 128 * 256 + 32 * 256 + 128 * 32 + 4 * 256 + 32 * 256 + 128 * 32 + 256 * 128  # q k v f_a f_b b g_a g_b o
    mla = 192 * 256 + 80 * 256 + 256 * 64 + 256 * 128  # q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj
    dense = 2 * 512 * 256 + 256 * 512
    moe = 8 * 256 + 2 * (256 * 256 + 256 * 128) + 2 * 128 * 256 + 256 * 128  # router, top-2 experts, shared
    flops = bench.model_prefill_flops(build_model("kimi-linear-tiny"), 100, 32)
    assert flops["linear"] == 100 * 2 * 2 * (kda + mla + dense + moe)
    assert flops["mla_attention"] == 2 * 2 * 4 * (32 + 16 + 32) * (100 * 101 // 2)
    assert flops["kda"] == 2 * 6 * 4 * 32 * 32 * 100
    assert flops["lm_head"] == 4 * 2 * 256 * 1024  # one position per chunk, 4 chunks
    assert flops["total"] == flops["linear"] + flops["mla_attention"] + flops["kda"] + flops["lm_head"]
    assert flops["reexpansion_flops"] == 2 * 2 * 64 * 4 * (32 + 32) * (32 + 64 + 96 - 0)


def test_prefill_model_level_records_a_row_per_length(tmp_path):
    """The model-level harness end to end on the CPU for the stock system (no compile: the unimem systems'
    smoke run is the documented command, ~30 s)."""
    bench = _script("bench_mla_prefill")
    out = tmp_path / "prefill.json"
    assert bench.main(["--model", "kimi-linear-tiny", "--device", "cpu", "--rows", "40", "20", "--chunk", "16",
                       "--systems", "stock", "--repeats", "1", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert [r["tokens"] for r in rec["rows"]] == [20, 40] and rec["max_seq_len"] == 56
    from unimem_compile.ops.kda import kda_prefill_backend
    assert rec["kda_prefill"] == kda_prefill_backend()
    for row in rec["rows"]:
        stock = row["systems"]["stock"]
        assert stock["prefill_ms"] > 0 and stock["prefill_tokens_per_s"] > 0 and row["bound_ms"] > 0
        assert stock["x_of_bound"] == stock["prefill_ms"] / row["bound_ms"]
        jit = stock["triton_compiles_per_run"]  # one count per timed run (None where Triton has no hook)
        assert len(jit) == 1 and all(n is None or (isinstance(n, int) and n >= 0) for n in jit)


def test_prefill_warm_up_reaches_three_workspace_pieces_where_the_rows_do():
    bench = _script("bench_mla_prefill")
    # 2 x 8192 + 4096: the last chunk's history spans three pieces (first, middle, last) before a timed run
    assert bench.warm_up_tokens([4096, 32768], 4096, workspace=8192) == 20480
    assert bench.warm_up_tokens([4096, 16384], 4096, workspace=8192) == 16384  # never past the longest row
    assert bench.warm_up_tokens([40, 20], 16, workspace=8) == 32  # two chunks at least
    assert bench.warm_up_tokens([20], 16, workspace=8) == 20


def test_prefill_model_level_batch_counts_every_row(tmp_path):
    """--batch 2: two rows per prefill; the FLOPs (and so the bound) and tokens/s count both rows."""
    bench = _script("bench_mla_prefill")
    recs = {}
    for batch in (1, 2):
        out = tmp_path / f"prefill_b{batch}.json"
        assert bench.main(["--model", "kimi-linear-tiny", "--device", "cpu", "--rows", "20", "--chunk", "16",
                           "--systems", "stock", "--repeats", "1", "--batch", str(batch), "--out", str(out)]) == 0
        recs[batch] = json.loads(out.read_text())
    assert recs[2]["batch"] == 2 and recs[1]["batch"] == 1
    one, two = recs[1]["rows"][0], recs[2]["rows"][0]
    assert two["flops"]["total"] == 2 * one["flops"]["total"] and two["flops"]["linear"] == 2 * one["flops"]["linear"]
    stock = two["systems"]["stock"]
    assert stock["prefill_tokens_per_s"] == pytest.approx(2 * 20 / stock["prefill_ms"] * 1e3)


def test_prefill_model_level_ab_env_interleaves_a_variant_of_each_system(tmp_path, monkeypatch):
    """--ab-env NAME=VALUE: every system is timed again with the variable set (the same model), the runs
    interleaved (system, variant, system, variant), and the variable is unset again outside the variant's runs."""
    bench = _script("bench_mla_prefill")
    seen = []
    real = bench._prefill

    def recording(model, ids, chunk):
        seen.append(os.environ.get("UNIMEM_AB_PROBE"))
        return real(model, ids, chunk)

    monkeypatch.setattr(bench, "_prefill", recording)
    monkeypatch.delenv("UNIMEM_AB_PROBE", raising=False)
    out = tmp_path / "prefill_ab.json"
    assert bench.main(["--model", "kimi-linear-tiny", "--device", "cpu", "--rows", "20", "--chunk", "16",
                       "--systems", "stock", "--repeats", "2", "--ab-env", "UNIMEM_AB_PROBE=7", "--out", str(out)]) == 0
    # the warm-up, the variant's two warm-ups with the variable, then the two repeats interleaved
    assert seen == [None, "7", "7", None, "7", None, "7"]
    assert "UNIMEM_AB_PROBE" not in os.environ
    rec = json.loads(out.read_text())
    variant = "stock[UNIMEM_AB_PROBE=7]"
    assert rec["systems"][variant]["environment"] == {"UNIMEM_AB_PROBE": "7"}
    row = rec["rows"][0]["systems"]
    assert set(row) == {"stock", variant} and all(len(row[s]["runs_ms"]) == 2 for s in row)
    assert all(row[s]["median_ms"] >= row[s]["prefill_ms"] > 0 for s in row)
    with pytest.raises(SystemExit):
        bench.main(["--model", "kimi-linear-tiny", "--device", "cpu", "--systems", "stock", "--ab-env", "NOVALUE"])
    with pytest.raises(SystemExit):
        bench.main(["--model", "kimi-linear-tiny", "--device", "cpu", "--systems", "stock", "--ab-env", "A=1+=2"])


def test_ab_env_variants_may_set_several_variables(monkeypatch):
    bench = _script("bench_mla_prefill")
    assert bench.parse_ab_env("UNIMEM_PREFILL_GRAPHS=2048,4096+UNIMEM_PREFILL_CONV=shifted") == [
        ("UNIMEM_PREFILL_GRAPHS", "2048,4096"), ("UNIMEM_PREFILL_CONV", "shifted")]
    assert bench.parse_ab_env("X=") == [("X", "")]
    with pytest.raises(ValueError, match=r"--ab-env takes NAME=VALUE\[\+NAME=VALUE\.\.\.\], got 'A=1\+B'"):
        bench.parse_ab_env("A=1+B")
    monkeypatch.delenv("UNIMEM_AB_P", raising=False)
    monkeypatch.setenv("UNIMEM_AB_Q", "q0")
    with bench._overridden([("UNIMEM_AB_P", "1"), ("UNIMEM_AB_Q", "2")]):
        assert (os.environ["UNIMEM_AB_P"], os.environ["UNIMEM_AB_Q"]) == ("1", "2")
    assert "UNIMEM_AB_P" not in os.environ and os.environ["UNIMEM_AB_Q"] == "q0"  # both put back


def test_prefill_engine_burst_packs_and_records_both_settings(tmp_path):
    """--engine-burst: the continuous-batching engine's prefill of a burst, packed and one row per forward,
    on the tiny model compiled for the CPU (aot_eager): both settings serve every prompt, packing uses fewer
    forwards, the pads are counted, and no compile falls into the timed bursts."""
    bench = _script("bench_mla_prefill")
    out = tmp_path / "burst.json"
    assert bench.main(["--model", "kimi-linear-tiny", "--device", "cpu", "--backend", "aot_eager", "--rows", "20",
                       "--chunk", "16", "--systems", "unimem", "--repeats", "1", "--engine-burst", "6",
                       "--burst-rows", "3", "--burst-budget", "64", "--burst-max-tokens", "24",
                       "--out", str(out)]) == 0
    rec = json.loads(out.read_text())["engine_burst"]
    assert rec["prompts"] == 6 and rec["rows"] == 3 and 6 <= rec["prompt_tokens"] <= 6 * 24
    burst = rec["systems"]["unimem"]
    packed, one = burst["packed"], burst["one_row"]
    assert packed["failed"] == one["failed"] == 0 and burst["graphs_compiled_in_timed_runs"] == 0
    assert one["forwards"] >= 6 and one["packed_forwards"] == one["packed_rows"] == one["prefill_pads"] == 0
    assert 0 < packed["packed_forwards"] <= packed["forwards"] < one["forwards"] and packed["packed_rows"] >= 2
    assert packed["ttft_max_ms"] >= packed["ttft_p50_ms"] > 0


def test_serving_traces_follow_their_definition():
    """bench_serving's traces (no model): counts, clips, the phased structure, --scale at the same rate."""
    bench = _script("bench_serving")
    full = bench.make_trace("stationary", rate=4.0, seed=0)
    assert len(full) == 3000 and [r["i"] for r in full] == list(range(3000))
    chat = [r for r in full if r["kind"] == "chat"]
    long = [r for r in full if r["kind"] == "long"]
    assert 0.01 < len(long) / 3000 < 0.03
    assert all(64 <= r["prompt"] <= 8192 and 16 <= r["output"] <= 512 for r in chat)
    assert 900 < sorted(r["prompt"] for r in chat)[len(chat) // 2] < 1150  # median 1024
    assert all(16 * 1024 <= r["prompt"] <= 96 * 1024 and r["output"] == 128 for r in long)
    assert 3000 / full[-1]["arrival"] == pytest.approx(4.0, rel=0.08)
    phased = bench.make_trace("phased", rate=4.0, seed=0)
    kinds = [r["kind"] for r in phased]
    assert kinds == ["chat"] * 1500 + ["long"] * 60 + ["chat"] * 1500
    longs = [r["arrival"] for r in phased if r["kind"] == "long"]
    assert longs[-1] - longs[0] <= 0.05 * phased[-1]["arrival"] * 1.1
    small = bench.make_trace("phased", rate=4.0, seed=0, scale=0.1)
    assert [r["kind"] for r in small] == ["chat"] * 150 + ["long"] * 6 + ["chat"] * 150
    assert small[149]["arrival"] == pytest.approx(phased[149]["arrival"])  # same rate, shorter trace


def test_serving_counts_triton_compiles_through_the_hook_and_restores_the_one_there():
    """bench_serving.TritonCompiles (a run's ``triton_compiles_in_run``): one name per post-compile hook call, the
    hook already installed still called with the same arguments, and put back on exit."""
    knobs = pytest.importorskip("triton").knobs
    bench = _script("bench_serving")
    seen = []

    def previous(*args, **kwargs):
        seen.append(kwargs["repr"])

    old = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = previous
    try:
        with bench.TritonCompiles() as jit:
            for name in ("_mla_prefill_kernel", "_kda_step_kernel", "_mla_prefill_kernel"):
                knobs.runtime.jit_post_compile_hook(key=(name,), repr=f"{name}[num_warps=4](n: i32)", fn=None)
        assert jit.available and jit.names == ["_mla_prefill_kernel", "_kda_step_kernel", "_mla_prefill_kernel"]
        assert seen == [f"{n}[num_warps=4](n: i32)" for n in jit.names]
        assert knobs.runtime.jit_post_compile_hook is previous
    finally:
        knobs.runtime.jit_post_compile_hook = old


# the H200 reduced runs' geometry (kimi-linear-48b-8l: 32 KDA heads; mla_prefill's 8192-token workspace) and the
# smoke run's (kimi-linear-tiny: 4 heads, max_seq_len 160, a 32-token budget)
_GPU_KW = dict(kda_heads=32, workspace_tokens=8192, arch=90)
_SMOKE_KW = dict(kda_heads=4, workspace_tokens=8192, arch=90)


def _planned(bench, groups, budget, kw, max_rows=1):
    return {v for g in groups for chunk in bench.chunk_plan(g, budget, max_rows)
            for v in bench.chunk_variants(chunk, **kw)}


@pytest.mark.parametrize("budget, max_prompt, kw, max_rows", [
    (4096, 96 * 1024 + 510, _GPU_KW, 1), (4096, 96 * 1024 + 510, _GPU_KW, 8), (32, 158, _SMOKE_KW, 1),
    (32, 158, _SMOKE_KW, 4), (3000, 20000, _GPU_KW, 1), (1000, 9000, dict(_GPU_KW, arch=80), 3),
    (10000, 30000, _GPU_KW, 1), (10000, 9000, _GPU_KW, 2)])
def test_serving_warm_up_reaches_every_kernel_variant_a_timed_run_can(budget, max_prompt, kw, max_rows):
    """bench_serving's warm-up plan: its chunks reach every (kernel, variant) any chunk of a timed run reaches
    (any length up to the budget, after any prefix; packs of up to max_rows whole prompts), and every prompt
    fits."""
    bench = _script("bench_serving")
    groups = bench.warm_up_groups(budget, max_prompt, max_rows, **kw)
    assert groups and all(max(g) <= max_prompt for g in groups)
    reachable = bench.reachable_variants(budget, max_prompt, max_rows, **kw)
    assert reachable - _planned(bench, groups, budget, kw, max_rows) == set()
    kinds = {what for what, _ in reachable}
    assert kinds == {"graph", "mla_kv_write", "mla_prefill", "fla_l2norm", "kda_graph"}
    packed = {v for what, v in reachable if what == "graph" and "packed" in v}
    assert bool(packed) == (max_rows > 1)
    if max_rows > 2:  # the batch size Dynamo specialises (2) and the dynamic one, padded or not
        assert {"chunk packed 2", "chunk packed 2 padded", "chunk packed 3+", "chunk packed 3+ padded"} <= packed


def test_serving_old_warm_up_missed_what_the_2026_12_02_timed_runs_compiled():
    """The warm-up before this plan (prompts of 3 x 4096 + 1, 1 and 2051 tokens at a 4096 budget) misses the
    variants the H200 run compiled inside its timed windows (fla's l2norm at NB = 1, the attention's 32- and
    64-query tiles, the write kernel's 2- and 4-token programs): the coverage check above can fail."""
    bench = _script("bench_serving")
    missed = bench.reachable_variants(4096, 96 * 1024 + 510, **_GPU_KW) - _planned(
        bench, [[3 * 4096 + 1, 1, 2051]], 4096, _GPU_KW)
    assert {("fla_l2norm", 1), ("mla_prefill", (32, False)), ("mla_prefill", (64, False)), ("mla_kv_write", (1, 2)),
            ("mla_kv_write", (1, 4))} <= missed


def test_serving_prefill_variants_follow_the_kernels_boundaries():
    """fla's l2norm autotune bucket turns at 2048 tokens x 32 heads; the attention tile at 16 / 32 / 64 queries;
    several workspace pieces past 8192 stored tokens; one token is the decode form (no prefill attention)."""
    bench = _script("bench_serving")

    def get(T, start, what):
        return [v for w, v in bench.prefill_variants(T, start, **_GPU_KW) if w == what]

    assert get(2048, 0, "fla_l2norm") == [1] and get(2049, 0, "fla_l2norm") == [2]
    assert [get(T, 0, "mla_prefill") for T in (2, 16, 17, 64, 65)] == [
        [(16, False)], [(16, False)], [(32, False)], [(64, False)], [(128, False)]]
    assert get(100, 8092, "mla_prefill") == [(128, False)] and get(100, 8093, "mla_prefill") == [(128, True)]
    assert get(1, 0, "mla_prefill") == [] and get(1, 0, "graph") == ["one-token first"]
    assert get(7, 3, "graph") == ["chunk later"]
    assert [get(T, 0, "kda_graph") for T in (2, 64, 65, 4096, 4097)] == [[(1, 64)], [(1, 64)], [(1, 128)],
                                                                         [(1, 4096)], [(1, None)]]
    assert get(1, 0, "kda_graph") == []  # one token: the recurrent decode form
    # a pack of rows x T: the write kernel, fla's l2norm and the chunk_kda graph see rows x T tokens
    packed = dict(bench.prefill_variants(512, 0, rows=4, padded=True, **_GPU_KW))
    assert packed["graph"] == "chunk packed 3+ padded" and packed["mla_kv_write"] == (4, 8)
    assert packed["fla_l2norm"] == 1 and packed["kda_graph"] == (4, 512) and packed["mla_prefill"] == (128, False)
    assert dict(bench.prefill_variants(2048, 0, rows=2, **_GPU_KW))["kda_graph"] == (2, 2048)
    assert dict(bench.prefill_variants(2049, 0, rows=2, **_GPU_KW))["kda_graph"] == (2, None)  # 2 x 4096 > 4096


def test_serving_chunk_plan_splits_the_budget_as_the_engine_does():
    """chunk_plan against the engine's chunks recorded on kimi-linear-tiny (budget 32: a request takes what
    the one before left of the step), and on random groups: each prompt's chunks tile it, in order, and no
    step exceeds the budget."""
    bench = _script("bench_serving")
    assert bench.chunk_plan([31, 48], 32) == [(31, 0, 1, False), (1, 0, 1, False), (32, 1, 1, False),
                                              (15, 33, 1, False)]
    assert bench.chunk_plan([30, 7], 32) == [(30, 0, 1, False), (2, 0, 1, False), (5, 2, 1, False)]
    assert bench.chunk_plan([39], 32) == [(32, 0, 1, False), (7, 32, 1, False)]
    # packing (recorded from Engine._prefill_chunk / _prefill_packed on kimi-linear-tiny, 8 rows, 2026-12-03):
    # whole prompts join the first one's forward while rows x the longest fits what is left of the step
    assert bench.chunk_plan([5, 12, 7, 9, 3, 11], 40, 8) == [(12, 0, 3, True), (4, 0, 1, False), (5, 4, 1, False),
                                                             (11, 0, 2, True)]
    assert bench.chunk_plan([30, 7, 7, 8, 2], 32, 8) == [(30, 0, 1, False), (2, 0, 1, False), (5, 2, 1, False),
                                                         (8, 0, 3, True)]
    assert bench.chunk_plan([20, 20, 20], 64, 8) == [(20, 0, 3, False)]
    assert bench.chunk_plan([20, 20, 20], 64, 2) == [(20, 0, 2, False), (20, 0, 1, False)]
    rng = np.random.default_rng(0)
    for _ in range(50):
        budget = int(rng.integers(1, 64))
        prompts = rng.integers(1, 200, int(rng.integers(1, 5))).tolist()
        max_rows = int(rng.integers(1, 5))
        chunks = bench.chunk_plan(prompts, budget, max_rows)
        if max_rows == 1:  # each prompt's chunks tile it
            assert sum(c.T for c in chunks) == sum(prompts)
        assert sum(c.rows * c.T for c in chunks) >= sum(prompts)  # pads on top of every prompt token
        assert sum(c.rows for c in chunks if c.rows > 1) <= len(prompts)
        assert all(1 <= c.rows <= max_rows and c.rows * c.T <= budget for c in chunks)
        assert all(c.start == 0 for c in chunks if c.rows > 1)
        assert min(c.start for c in chunks) == 0


def test_serving_marks_a_run_that_compiled_as_confounded_and_warns_in_the_ratios():
    """confounded_by_jit: True when Dynamo or Triton compiled inside the timed run, None when Triton's count is
    unknown; comparison(): unified over every engine system, the 50/50 names of record, and a warning naming
    the confounded systems."""
    bench = _script("bench_serving")
    assert bench.confounded_by_jit(0, 0) is False and bench.confounded_by_jit(0, 35) is True
    assert bench.confounded_by_jit(1, None) is True and bench.confounded_by_jit(0, None) is None
    assert bench.confounded_by_jit(0, 0, 1) is True and bench.confounded_by_jit(0, None, 2) is True
    clean = {"mean_concurrent": 4.0, "ttft_p99_s": 1.0, "confounded_by_jit": False}
    results = {"unified": clean, "static0.5": {"mean_concurrent": 2.0, "ttft_p99_s": 4.0, "confounded_by_jit": True},
               "static0.25": {"mean_concurrent": 5.0, "ttft_p99_s": 2.0, "confounded_by_jit": False},
               "stock_cb": {"system": "stock generate_batch", "error": "ValueError: ..."}}
    ratios = bench.comparison(results)
    assert ratios["unified_over_static0.5_mean_concurrent"] == 2.0 and ratios["ttft_p99_over_50_50"] == 0.25
    assert ratios["unified_over_50_50_mean_concurrent"] == 2.0
    assert ratios["unified_over_static0.25_mean_concurrent"] == 0.8
    assert "static0.5" in ratios["warning"] and "static0.25" not in ratios["warning"]
    assert not any("stock" in k for k in ratios)
    del results["static0.5"]
    assert "warning" not in bench.comparison(results)
    assert bench.comparison({"static0.5": clean}) is None


def test_serving_queued_concurrency_averages_only_the_samples_with_a_queue():
    bench = _script("bench_serving")
    got = bench.queued_concurrency([3, 5, 8, 8, 6, 2], [0, 0, 4, 1, 0, 0])
    assert got == {"queued_fraction": 2 / 6, "mean_concurrent_while_queued": 8.0}
    got = bench.queued_concurrency([1, 7, 2], [0, 3, 2])
    assert got == {"queued_fraction": 2 / 3, "mean_concurrent_while_queued": 4.5}
    assert bench.queued_concurrency([4, 4], [0, 0]) == {"queued_fraction": 0.0, "mean_concurrent_while_queued": None}
    assert bench.queued_concurrency([], []) == {"queued_fraction": 0.0, "mean_concurrent_while_queued": None}
    with pytest.raises(ValueError, match=r"one timeline, got \(3,\) and \(2,\) samples"):
        bench.queued_concurrency([1, 2, 3], [0, 1])


def test_serving_rate_search_returns_only_a_rate_it_measured_bounded():
    """find_rate against a stand-in engine whose queue is bounded below a known capacity: the floor is run
    first and halved while unbounded (2026-12-02's search bisected above an unbounded floor of 4/s and
    returned 4/s, never run); the result is the highest rate measured bounded, or ``bounded`` False."""
    import argparse
    import warnings

    bench = _script("bench_serving")
    rng = np.random.default_rng(7)

    def engine(capacity):
        def run(rate):
            n = int(rng.integers(40, 80))
            base = rng.integers(0, 5, n)  # a noisy queue that stays flat, or one that grows with time
            waiting = base + (2 * np.arange(n) if rate > capacity else 0)
            return {"timeline": {"waiting": waiting.astype(int).tolist()}, "seconds": 1.0, "confounded_by_jit": False}
        return run

    args = argparse.Namespace(rate_lo=4.0, rate_hi=52.0, rate_iters=5)
    r = bench.find_rate(None, args, run=engine(capacity=2.7))
    rates = [t["rate"] for t in r["tried"]]
    assert rates[:3] == [4.0, 2.0, 3.0] and r["bounded"] is True
    assert r["rate"] == max(t["rate"] for t in r["tried"] if t["bounded"]) and 2.5 <= r["rate"] <= 2.7
    assert all(t["bounded"] == (t["rate"] <= 2.7) for t in r["tried"])
    r = bench.find_rate(None, args, run=engine(capacity=30.0))
    assert [t["rate"] for t in r["tried"]][:2] == [4.0, 28.0] and r["bounded"] and 28.0 <= r["rate"] <= 30.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = bench.find_rate(None, args, run=engine(capacity=0.01))
    assert r["bounded"] is False and r["rate"] == 0.125 and not any(t["bounded"] for t in r["tried"])
    assert any("0.125/s was never run" in str(w.message) for w in caught)
    assert bench.queue_bounded([3, 3]) and bench.queue_bounded([5, 9, 2, 1, 17])
    assert not bench.queue_bounded([5, 9, 2, 1, 18])


def test_serving_time_split_accounts_for_the_wall_from_the_engine_counters():
    """time_split: decode + prefill + the rest of the steps = step_s, step_s + idle = the run's wall."""
    bench = _script("bench_serving")
    rng = np.random.default_rng(3)
    decode, prefill, rest, idle = rng.uniform(0.5, 5.0, 4)
    counters = {"steps": 517, "step_s": decode + prefill + rest, "decode_s": decode, "prefill_s": prefill,
                "prefill_chunks": 61, "prefill_tokens": 40_960}
    ts = bench.time_split(counters, {"compactions": 3, "bytes_moved": 1 << 20}, decode + prefill + rest + idle)
    assert ts["steps"] == 517 and ts["prefill_chunks"] == 61 and ts["compactions"] == 3 and ts["bytes_moved"] == 1 << 20
    assert abs(ts["other_step_s"] - rest) < 1e-9 and abs(ts["idle_s"] - idle) < 1e-9
    assert abs(ts["decode_s"] + ts["prefill_s"] + ts["other_step_s"] - ts["step_s"]) < 1e-9
    assert abs(ts["prefill_tokens_per_s"] - 40_960 / prefill) < 1e-6
    assert bench.time_split(dict(counters, prefill_s=0.0, prefill_tokens=0), {}, 10.0)["prefill_tokens_per_s"] is None


def test_serving_logs_each_prefill_forward_and_summarises_by_kind():
    """log_prefill_forwards wraps one engine instance's forward (the class keeps its own), records (tokens, start,
    ms, final, rows decoding) per call and passes the logits through; prefill_forwards' counts per kind are exact
    and its percentiles are numpy's over the recorded ms."""
    bench = _script("bench_serving")
    rng = np.random.default_rng(11)
    plan = [(int(rng.integers(16, 3000)), bool(rng.integers(0, 2))) for _ in range(40)]

    class Req:
        prefilled = 0
        ends_prompt = False  # whether the next chunk is the prompt's last (the stand-in then returns logits)

    class StandIn:
        def __init__(self):
            self.rows = []

        def _prefill_chunk(self, req, chunk):
            req.prefilled += chunk
            return "logits" if req.ends_prompt else None

    engine = StandIn()
    log = bench.log_prefill_forwards(engine)
    assert StandIn._prefill_chunk is not engine._prefill_chunk
    req, starts = Req(), []
    for i, (tokens, done) in enumerate(plan):
        engine.rows = [None] * (i % 5)
        starts.append(req.prefilled)
        req.ends_prompt = done
        assert engine._prefill_chunk(req, tokens) == ("logits" if done else None)
        if done:
            req.prefilled = 0
    assert [(t, s, f, r, n) for t, s, _, f, r, n in log] == [(t, s, d, i % 5, 1) for i, ((t, d), s) in
                                                             enumerate(zip(plan, starts))]
    ms = np.array([e[2] for e in log])
    assert (ms >= 0).all()
    pf = bench.prefill_forwards(log)
    first = np.array([s == 0 for s in starts])
    assert pf["all"]["forwards"] == 40 and pf["first_chunk"]["forwards"] == int(first.sum())
    assert pf["later_chunk"]["forwards"] == 40 - int(first.sum())
    assert pf["final"]["forwards"] == sum(d for _, d in plan)
    assert pf["under_1k_tokens"]["forwards"] == sum(t < 1024 for t, _ in plan)
    assert pf["all"]["p50_ms"] == float(np.percentile(ms, 50)) and pf["all"]["max_ms"] == float(ms.max())
    assert [e["ms"] for e in pf["slowest"]] == sorted(ms.tolist(), reverse=True)[:5]
    assert pf["packed"]["forwards"] == 0  # the stand-in has no _prefill_packed: nothing wrapped there
    fixed = [(100, 0, 5.0, True, 1, 1), (200, 0, 10.0, True, 2, 3), (400, 100, 20.0, False, 4, 1)]
    pf = bench.prefill_forwards(fixed)
    assert pf["ms_per_1k_tokens_p50"] == 50.0 and abs(pf["corr_ms_rows_decoding"] - 1.0) < 1e-12
    assert pf["packed"] == {"forwards": 1, "p50_ms": 10.0, "p90_ms": 10.0, "max_ms": 10.0}
    assert pf["from_1k_tokens"] == {"forwards": 0, "p50_ms": None, "p90_ms": None, "max_ms": None}
    assert bench.prefill_forwards([]) is None


def test_serving_prefill_probe_times_the_three_ways_and_counts_the_engine_forwards():
    """prefill_probe on the tiny model (CPU, aot_eager, no warm-up: the first call of each way compiles, untimed):
    one row per probe length that fits max_seq_len, every wall positive, the engine's forwards per request
    exactly ceil(tokens / chunk), the profiled length carries a kernel breakdown, and the pool is empty after."""
    import argparse

    bench = _script("bench_serving")
    args = argparse.Namespace(smoke=True, model=None, budget_gib=None, max_batch=None, max_seq_len=None,
                              page_size=None, scale=1.0, rate=None, max_prefill_tokens=4096, seed=0,
                              device="cpu", keep_stock=False)
    bench.apply_presets(args)
    torch._dynamo.reset()
    model, _ = bench.build(args)
    probe = bench.prefill_probe(model, args, repeats=1)
    lengths = [max(2, n // 32) for n in bench.PROBE_LENGTHS]
    assert [r["tokens"] for r in probe["lengths"]] == [n for n in lengths if n + 2 <= args.max_seq_len]
    assert probe["chunk"] == args.max_prefill_tokens == 32
    for r in probe["lengths"]:
        assert r["engine_forwards"] == -(-r["tokens"] // 32)
        walls = r["generate_ms"], r["engine_sync_ms"], r["engine_thread_ms"], r["engine_prefill_ms_per_forward"]
        assert min(walls) > 0
    profiled = [r for r in probe["lengths"] if "profile" in r]
    assert [r["tokens"] for r in profiled] == [lengths[0]]
    assert profiled[0]["profile"]["wall_ms"] > 0 and profiled[0]["profile"]["by_category"]
    s = model.unimem.stats()
    assert (s["kv_pages_used"], s["state_slots_used"]) == (0, 0)


def test_serving_deadline_skips_systems_and_still_writes_the_record(tmp_path):
    """--deadline-s 0: every system is recorded as skipped (nothing timed runs, so no warm-up either), the
    JSON and the plot are written, with the rate and where it came from."""
    bench = _script("bench_serving")
    out = tmp_path / "serving.json"
    assert bench.main(["--device", "cpu", "--smoke", "--systems", "stock_cb,stock_static", "--traces", "phased",
                       "--rate", "5", "--deadline-s", "0", "--out", str(out), "--plots", str(tmp_path)]) == 0
    rec = json.loads(out.read_text())
    assert rec["rate"] == 5.0 and rec["rate_source"] == "--rate" and "warm_up" not in rec
    from unimem_compile.ops.kda import kda_prefill_backend
    assert rec["kda_prefill"] == kda_prefill_backend() and rec["kda_prefill"]["backend"] in ("fla", "reference")
    assert set(rec["results"]["phased"]) == {"stock_cb", "stock_static"}
    assert all("--deadline-s 0" in r["skipped"] for r in rec["results"]["phased"].values())
    assert (tmp_path / "serving.png").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cuda_kernels_refuses_without_cuda_instead_of_reporting_no_launch():
    from unimem_compile.profiling import cuda_kernels

    calls = []
    with pytest.raises(RuntimeError, match="needs CUDA"):
        cuda_kernels(lambda: calls.append(1))
    assert calls == []  # refused before running the function
