"""Sizing without allocation and the pool-info command."""

import json
import math

import pytest
import torch

from unimem_compile.cli import main
from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, geometry, max_requests, padded_group_bytes, pool_info

GIB = 1 << 30


def test_kimi_linear_geometry_is_the_real_checkpoint_geometry():
    kv, state = geometry("kimi-linear-48b")
    assert (kv.layer_num, kv.kv_lora_rank, kv.qk_rope_head_dim, kv.dtype) == (7, 512, 64, torch.bfloat16)
    assert state.layer_num == 20
    layer = state.layers[0]
    assert layer.conv.shape == (3 * 32 * 128, 4) and layer.conv.dtype == torch.bfloat16
    assert layer.recurrent.shape == (32, 128, 128) and layer.recurrent.dtype == torch.float32


def test_pool_info_of_40_gib_kimi_linear_has_under_half_a_percent_overhead():
    kv, state = geometry("kimi-linear-48b")
    info = pool_info(kv, state, 40 * GIB, 64, "kimi-linear-48b")
    page_bytes = 64 * 7 * 576 * 2
    per_layer = 3 * 32 * 128 * 4 * 2 + 32 * 128 * 128 * 4  # conv + recurrent, both 16-byte multiples
    assert info["page_bytes"] == page_bytes
    assert info["slot_bytes"] == 20 * per_layer
    assert info["overhead_fraction"] < 0.005
    usable = 40 * GIB - page_bytes
    sink = 20 * per_layer
    assert info["max_kv_tokens"] == (usable // page_bytes - math.ceil(sink / page_bytes)) * 64
    assert info["max_state_slots"] == usable // (20 * per_layer) - 1
    r = info["request_4096"]
    assert r["bytes_needed"] == 4096 * 7 * 1152 + 20 * per_layer
    assert r["bytes_allocated"] == r["bytes_needed"]  # 4096 is a whole number of 64-token pages
    assert 1.15 < r["padded_group_bytes_allocated"] / r["bytes_needed"] < 1.25
    assert [m["tokens_per_request"] for m in info["mixes"]] == [4096, 32768, 131072]


def test_max_requests_is_the_largest_count_that_fits():
    kv = MLASpec(2, 32, 16, torch.float32)
    st = LinearStateSpec.kda(1, 2, 8, 4, torch.float32)
    lay = ArenaLayout(200_000, 16, kv, st)
    for tokens in (1, 40, 300):
        n = max_requests(lay, tokens)
        pages = math.ceil(tokens / 16)
        assert lay.fits(n * pages, n) and not lay.fits((n + 1) * pages, n + 1)


def test_padded_group_model_pads_blocks_and_groups():
    kv = MLASpec(2, 32, 16, torch.float32)  # 192 bytes per token per layer
    st = LinearStateSpec.kda(3, 2, 8, 4, torch.float32)
    per_layer_state = st.slot_bytes // 3
    block = math.ceil(math.ceil(per_layer_state / 192) / 16) * 16
    page = block * 192
    # 2 attention layers, 3 linear layers padded to 4 (groups of 2)
    assert padded_group_bytes(kv, st, 100) == 2 * math.ceil(100 / block) * page + 4 * page


def test_pool_info_cli_prints_the_design_keys(capsys):
    assert main(["pool-info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info) == {"geometry", "budget_bytes", "page_size", "page_bytes", "slot_bytes", "max_kv_tokens",
                         "max_state_slots", "overhead_fraction", "mixes", "request_4096"}
    assert set(info["request_4096"]) == {"bytes_needed", "bytes_allocated", "padded_group_bytes_allocated"}
    assert info["budget_bytes"] == 40 * GIB and info["overhead_fraction"] < 0.005
    assert main(["pool-info", "--budget-gib", "2", "--page-size", "16"]) == 0
    assert "16 tokens" in capsys.readouterr().out


def test_pool_info_sizes_fp8_rows_with_the_same_keys(capsys):
    assert main(["pool-info", "--json"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert main(["pool-info", "--kv-dtype", "fp8_e4m3", "--json"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert set(fp8) == set(bf16) and fp8["slot_bytes"] == bf16["slot_bytes"]
    assert fp8["page_bytes"] == 64 * 7 * 656 and bf16["page_bytes"] == 64 * 7 * 1152
    layout = ArenaLayout(40 * GIB, 64, MLASpec(7, 512, 64, torch.float8_e4m3fn), geometry("kimi-linear-48b")[1])
    assert fp8["max_kv_tokens"] == layout.max_kv_tokens  # counts fp8 rows: 1.76x the bf16 figure
    assert 1.75 < fp8["max_kv_tokens"] / bf16["max_kv_tokens"] < 1.76
    assert fp8["request_4096"]["bytes_needed"] == 4096 * 7 * 656 + geometry("kimi-linear-48b")[1].raw_bytes
    assert main(["pool-info", "--kv-dtype", "fp8_e4m3fnuz"]) == 0
    assert "float8_e4m3fnuz, 656 bytes per token per layer" in capsys.readouterr().out


def test_pool_info_kv_dtype_takes_every_name_compile_takes_and_refuses_what_it_refuses(capsys):
    """--kv-dtype used to take only the short names; compile()'s torch dtype names size the same rows, and a
    format compile() refuses (fp8_e5m2, which had a spelling hint: it is a real format) exits 2 with one line."""
    for short, names in (("fp8_e4m3", ("float8_e4m3fn", "torch.float8_e4m3fn", "fp8_e4m3fn")),
                         ("fp8_e4m3fnuz", ("float8_e4m3fnuz",)), ("bf16", ("bfloat16", "torch.bfloat16")),
                         ("fp32", ("float32", "float"))):
        assert main(["pool-info", "--kv-dtype", short, "--json"]) == 0
        want = json.loads(capsys.readouterr().out)
        for name in names:
            assert main(["pool-info", "--kv-dtype", name, "--json"]) == 0, capsys.readouterr().err
            assert json.loads(capsys.readouterr().out) == want, name
    assert want["page_bytes"] == 64 * 7 * 576 * 4
    for name, line in (("fp8_e5m2", "unimem-compile pool-info: --kv-dtype 'fp8_e5m2' is float8_e5m2, which the MLA "
                                    "ops cannot store; accepted: bfloat16, float16, float32, float8_e4m3fn, "
                                    "float8_e4m3fnuz"),
                       ("float8_e5m2", "--kv-dtype 'float8_e5m2' is float8_e5m2, which the MLA ops cannot store"),
                       ("bfloat17", "unimem-compile pool-info: --kv-dtype: kv_dtype 'bfloat17' does not name a torch "
                                    "dtype;")):
        assert main(["pool-info", "--kv-dtype", name, "--json"]) == 2
        captured = capsys.readouterr()
        assert line in captured.err and captured.err.count("\n") == 1 and captured.out == "", captured.err


@pytest.mark.parametrize("argv, message", [
    (["--page-size", "0"], "--page-size must be a positive number of tokens, got 0"),
    (["--budget-gib", "-1"], "--budget-gib must be a positive, finite number of GiB, got -1"),
    (["--budget-gib", "inf"], "--budget-gib must be a positive, finite number of GiB, got inf"),
    (["--budget-gib", "nan"], "--budget-gib must be a positive, finite number of GiB, got nan"),
    (["--budget-gib", "1e-300"], "--budget-gib 1e-300 is less than one byte"),
    (["--budget-gib", "0.0001"], "memory_budget=107374 bytes is below the minimum"),
])
def test_pool_info_cli_refuses_bad_sizes_with_exit_status_2(argv, message, capsys):
    assert main(["pool-info", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("unimem-compile pool-info: ") and message in err and "Traceback" not in err


def test_pool_info_of_a_model_without_states_prints_no_state_lines(capsys):
    assert main(["pool-info", "--geometry", "deepseek-v3", "--budget-gib", "2"]) == 0
    out = capsys.readouterr().out
    assert "max KV tokens" in out and "states take no room" not in out
    assert "slot" not in out and "state" not in out and "hybrid allocator" not in out
    assert main(["pool-info", "--budget-gib", "2"]) == 0  # Kimi-Linear: both kinds, all lines
    out = capsys.readouterr().out
    assert "slot pitch" in out and "(states take no room)" in out and "hybrid allocator padding" in out


def _kimi_48b_config():
    """A transformers config of Kimi-Linear-48B-A3B's 27 layers (7 MLA, 20 KDA) at its real geometry, bf16."""
    from unimem_compile.hf.models import model_config

    config = model_config("kimi-linear-48b-4l")
    config.num_hidden_layers = 27
    config.layer_types = (["linear_attention"] * 3 + ["full_attention"]) * 6 + ["linear_attention"] * 2 + [
        "full_attention"]
    config.mlp_layer_types = ["dense"] + ["sparse"] * 26
    config.dtype = torch.bfloat16
    return config


def test_pool_info_of_a_config_json_equals_the_built_in_geometry_it_describes(tmp_path, capsys):
    _kimi_48b_config().save_pretrained(tmp_path)
    assert main(["pool-info", "--json"]) == 0
    built_in = json.loads(capsys.readouterr().out)
    for path in (tmp_path / "config.json", tmp_path):  # the file, or the folder holding it
        assert main(["pool-info", "--json", "--config", str(path)]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info.pop("geometry") == f"kimi_linear from {path}"
        assert info == {k: v for k, v in built_in.items() if k != "geometry"}


def test_pool_info_refuses_a_missing_or_unsupported_config_with_exit_status_2(tmp_path, capsys):
    from transformers import LlamaConfig

    assert main(["pool-info", "--config", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err == (f"unimem-compile pool-info: --config {tmp_path / 'nothing'}: no such file or "
                                       f"folder (a config.json, or the folder that holds one)\n")
    assert main(["pool-info", "--config", str(tmp_path)]) == 2  # an empty folder
    assert capsys.readouterr().err == (f"unimem-compile pool-info: --config {tmp_path}: the folder holds no "
                                       f"config.json\n")
    LlamaConfig(num_hidden_layers=2).save_pretrained(tmp_path)
    assert main(["pool-info", "--config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "model_type='llama') is not supported; supported: KimiLinearForCausalLM" in err and "Traceback" not in err
