"""``unimem-compile inspect``: one MLA layer's decode (or prefill) graph before and after, with the counts."""

import torch

from unimem_compile.cli import main


def test_inspect_prints_the_layer_before_and_after_with_counts(capsys):
    torch._dynamo.reset()
    assert main(["inspect", "--model", "deepseek-v3-tiny"]) == 0
    out = capsys.readouterr().out
    before, after = out.split("# after the rewrites")
    assert "model.layers.0.self_attn" in before
    assert "unimem.mla_gather(" in before and "scaled_dot_product_attention(" in before
    assert "unimem.mla_decode(" in after and "unimem.mla_kv_write_rmsnorm(" in after
    assert "mla_gather(" not in after and "scaled_dot_product_attention(" not in after
    assert "replacements in this decode graph: mla_write_fusion 3, mla_absorb 3" in after


def test_inspect_prints_the_prefill_layer_attending_on_the_pages(capsys):
    torch._dynamo.reset()
    assert main(["inspect", "--model", "deepseek-v3-tiny", "--graph", "prefill"]) == 0
    out = capsys.readouterr().out
    before, after = out.split("# after the rewrites")
    assert "prefill graph of model.layers.0.self_attn" in before
    assert "unimem.mla_gather(" in before and "scaled_dot_product_attention(" in before
    assert "unimem.mla_prefill(" in after and "mla_gather(" not in after
    assert "scaled_dot_product_attention(" not in after
    assert "replacements in this prefill graph: mla_write_fusion 3, mla_absorb 0" in after
    assert "mla_prefill 3" in after
