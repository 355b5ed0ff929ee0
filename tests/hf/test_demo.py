"""The main job's report: `unimem-compile demo --json` keys (docs/design.md section 5) and parity."""

import json

import pytest

from unimem_compile.cli import main
from unimem_compile.demo import PROMPTS, ByteTokenizer


def test_byte_tokenizer_round_trips_and_left_pads():
    tok = ByteTokenizer()
    ids, mask = tok.encode_batch(PROMPTS[:2], "cpu")
    assert ids.shape[1] == max(len(p) for p in PROMPTS[:2]) + 1
    for i, text in enumerate(PROMPTS[:2]):
        n = len(text) + 1
        assert mask[i].sum() == n and bool(mask[i, -n:].all())
        assert tok.decode(ids[i]) == text


@pytest.mark.parametrize("model", ["kimi-linear-tiny"])
def test_demo_json_has_the_design_keys_and_parity(model, capsys):
    assert main(["demo", "--model", model, "--backend", "aot_eager", "--new-tokens", "6", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r) == {"model", "device", "dtype", "torch", "transformers", "parity", "parity_detail", "tokens_per_s",
                      "reference_tokens_per_s", "compile_s", "achieved_bandwidth_gbs", "pool", "rewrites"}
    assert set(r["parity_detail"]) == {"criterion", "tokens_identical", "max_abs_logit_diff", "tolerance"}
    assert set(r["pool"]) == {"total_bytes", "kv_pages_peak", "state_slots_peak", "kv_pages_used",
                              "state_slots_used", "overhead_fraction"}
    assert set(r["rewrites"]) >= {"mla_write_fusion", "mla_absorb", "kda_state_inplace", "conv_state_inplace"}
    assert r["parity"] is True and r["parity_detail"]["criterion"] == "tokens"  # fp32 on the CPU
    assert r["parity_detail"]["tokens_identical"] is True
    assert r["model"] == model and r["device"] == "cpu" and r["dtype"] == "float32"
    assert r["pool"]["kv_pages_used"] == 0 and r["pool"]["kv_pages_peak"] > 0 and r["pool"]["state_slots_peak"] == 4
    assert r["tokens_per_s"] > 0 and r["reference_tokens_per_s"] > 0 and r["achieved_bandwidth_gbs"] > 0


def test_demo_with_fp8_kv_reports_logit_parity_against_fp32_kv(capsys):
    assert main(["demo", "--backend", "aot_eager", "--new-tokens", "6", "--kv-dtype", "fp8_e4m3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    d = r["parity_detail"]
    assert {"criterion", "tokens_identical", "max_abs_logit_diff", "tolerance"} <= set(d)
    assert d["criterion"] == "fp8_logits" and d["kv_dtype"] == "float8_e4m3fn" and r["dtype"] == "float32"
    c = d["fp8_vs_reference"]
    assert c["positions"] == 4 * 6 and 0 < c["median_position"] <= d["tolerance"] and r["parity"] is True
    assert d["tolerance"] == 2**-4 * d["logit_spread"] and c["max_abs"] == d["max_abs_logit_diff"]
    assert 0 <= c["kl_median"] < 1e-3 and 0 <= c["kl_mean"] < 1e-3  # nats (about 1e-5 here)
    assert 0 < c["top1_agreement"] <= 1 and r["pool"]["kv_pages_used"] == 0


@pytest.mark.parametrize("args, message", [
    (["--new-tokens", "1"], "new_tokens must be an int >= 2"),
    (["--page-size", "0"], "page_size must be a positive int, got 0"),
    (["--backend", "bogus"], "unknown torch.compile backend 'bogus'"),
])
def test_demo_refuses_bad_arguments_before_running_anything(args, message, capsys):
    assert main(["demo", "--backend", "aot_eager", *args]) == 2
    assert message in capsys.readouterr().err
