"""The tensor-parallel plan and its pieces, in one process: world size 2 simulated by slicing.

A column-parallel shard must be the slice of the full weight; the row-parallel partial products of the
ranks must add up to the full product, module by module (MLA and KDA attention, dense MLP, MoE block), and
the ranks' lm_head slices must concatenate to the full logits. Also: the refusals, the per-rank state sizing,
the determinism of the pool (every rank feeds its allocator the same calls), and the digests the ranks
compare.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import unimem_compile
from unimem_compile.cli import main
from unimem_compile.errors import GeometryError, PoolExhausted, UnsupportedModel
from unimem_compile.hf.models import build_model, model_config
from unimem_compile.options import CompileOptions
from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, UnifiedPool, geometry, pool_info
from unimem_compile.tp.group import _differences, call_digest
from unimem_compile.tp.plan import BIAS_ON_RANK0, Split, TensorParallelPlan, apply_plan, plan_model, shard_tensor
from unimem_compile.tp.sizing import pool_info_tp, shard_state_spec

WORLD = 2
# fp32 on a CPU; the ranks' partial sums are added in another order than one matmul adds them: a few ulp of
# the outputs (|output| <= ~2 here), far below any difference a wrong slice would make (O(|output|))
ATOL = 1e-5


def _identity(module, args, output):
    return output


def _model(name):
    """A preset, or ``deepseek-v2-tiny``: the DeepSeek-V3 tiny sizes in transformers' DeepSeek-V2 classes."""
    if name != "deepseek-v2-tiny":
        return build_model(name)
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    sizes = {k: getattr(model_config("deepseek-v3-tiny"), k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
        "first_k_dense_replace")}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(DeepseekV2Config(**sizes, n_group=1, topk_group=1)).eval()


def _ranks(model):
    """The model cut for each of WORLD ranks with identity hooks (each rank's output stays partial)."""
    plan = plan_model(model, WORLD)
    shards = []
    for rank in range(WORLD):
        shard = copy.deepcopy(model)
        apply_plan(shard, plan, rank, _identity, _identity)
        shards.append(shard)
    return plan, shards


# ---------------------------------------------------------------------------------------------- shard_tensor
@pytest.mark.parametrize("shape, split", [((12, 5), Split(0)), ((5, 12), Split(1)), ((12, 1, 4), Split(0, 3)),
                                          ((3, 8, 6), Split(1, 2)), ((1, 1, 4, 1), Split(2))])
def test_shards_are_the_slices_and_own_their_memory(shape, split, gen):
    full = torch.randn(shape, generator=gen)
    dim = split.dim
    block = full.shape[dim] // split.parts
    piece = block // WORLD
    for rank in range(WORLD):
        shard = shard_tensor(full, split, rank, WORLD)
        expected = torch.cat([full.narrow(dim, b * block + rank * piece, piece) for b in range(split.parts)], dim)
        assert torch.equal(shard, expected)
        assert shard.is_contiguous() and shard.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
    # the shards of every block, put back in rank order, are the block
    shards = [shard_tensor(full, split, r, WORLD) for r in range(WORLD)]
    for b in range(split.parts):
        rebuilt = torch.cat([s.narrow(dim, b * piece, piece) for s in shards], dim)
        assert torch.equal(rebuilt, full.narrow(dim, b * block, block))


def test_a_dimension_that_does_not_divide_is_refused_with_its_size():
    with pytest.raises(GeometryError, match=r"3 blocks of 5 does not divide over 2 ranks.*\[15, 4\]"):
        shard_tensor(torch.ones(15, 4), Split(0, 3), 0, 2)


# ---------------------------------------------------------------------------------------------- modules
def _first(model, kind):
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if kind == "mla" and hasattr(attn, "kv_b_proj"):
            return i
        if kind == "kda" and hasattr(attn, "conv1d"):
            return i
        if kind == "moe" and hasattr(layer.mlp, "experts"):
            return i
        if kind == "dense" and hasattr(layer.mlp, "gate_proj"):
            return i
    raise AssertionError(kind)


def _attention_output(model, i, hidden):
    attn = model.model.layers[i].self_attn
    if hasattr(attn, "conv1d"):  # KDA, no cache: transformers' chunked torch path
        return attn(hidden_states=hidden, cache=None, attention_mask=None)
    kwargs = {}
    if hasattr(model.model, "rotary_emb"):  # DeepSeek: RoPE on q_rot / k_rot
        positions = torch.arange(hidden.shape[1])[None]
        kwargs["position_embeddings"] = model.model.rotary_emb(hidden, positions)
    return attn(hidden_states=hidden, attention_mask=None, **kwargs)[0]


@pytest.mark.parametrize("name, kind", [("kimi-linear-tiny", "mla"), ("kimi-linear-tiny", "kda"),
                                        ("deepseek-v3-tiny", "mla"), ("deepseek-v2-tiny", "mla")])
def test_attention_partial_outputs_add_up_to_the_full_output(name, kind, gen):
    model = _model(name)
    _, shards = _ranks(model)
    i = _first(model, kind)
    hidden = torch.randn(2, 7, model.config.hidden_size, generator=gen)
    with torch.no_grad():
        full = _attention_output(model, i, hidden)
        parts = [_attention_output(s, i, hidden) for s in shards]
    assert full.abs().max() > 1e-3  # a real signal, not zeros
    torch.testing.assert_close(sum(parts), full, atol=ATOL, rtol=0)
    attn = shards[0].model.layers[i].self_attn
    heads = model.config.linear_num_heads if kind == "kda" else model.config.num_attention_heads
    assert attn.num_heads == heads // WORLD


@pytest.mark.parametrize("name, kind", [("kimi-linear-tiny", "dense"), ("kimi-linear-tiny", "moe"),
                                        ("deepseek-v3-tiny", "dense"), ("deepseek-v3-tiny", "moe"),
                                        ("deepseek-v2-tiny", "moe")])
def test_mlp_partial_outputs_add_up_to_the_full_output(name, kind, gen):
    model = _model(name)
    _, shards = _ranks(model)
    i = _first(model, kind)
    hidden = torch.randn(2, 5, model.config.hidden_size, generator=gen)
    with torch.no_grad():
        full = model.model.layers[i].mlp(hidden)
        parts = [s.model.layers[i].mlp(hidden) for s in shards]
    assert full.abs().max() > 1e-3
    torch.testing.assert_close(sum(parts), full, atol=ATOL, rtol=0)


def test_lm_head_slices_concatenate_to_the_full_logits(gen):
    model = build_model("kimi-linear-tiny")
    plan, shards = _ranks(model)
    hidden = torch.randn(3, model.config.hidden_size, generator=gen)
    with torch.no_grad():
        full = model.lm_head(hidden)
        assert torch.equal(torch.cat([s.lm_head(hidden) for s in shards], -1), full)
    assert plan.gather_outputs == ["lm_head"]


def test_row_parallel_bias_is_added_once(gen):
    full = nn.Linear(8, 3)
    nn.init.normal_(full.bias)
    x = torch.randn(4, 8, generator=gen)
    plan = TensorParallelPlan(WORLD, params={"0.weight": Split(1), "0.bias": BIAS_ON_RANK0})
    parts = []
    for rank in range(WORLD):
        shard = nn.Sequential(copy.deepcopy(full))
        apply_plan(shard, plan, rank, _identity, _identity)
        parts.append(shard(x[:, rank * 4:(rank + 1) * 4]))
    with torch.no_grad():
        torch.testing.assert_close(sum(parts), full(x), atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- the plan
def test_plan_follows_transformers_tp_plan_for_the_mlps():
    model = build_model("kimi-linear-tiny")
    tp_plan = model.config.base_model_tp_plan
    assert tp_plan["layers.*.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert tp_plan["layers.*.mlp.experts.down_proj"] == "rowwise"
    plan = plan_model(model, WORLD)
    assert plan.params["model.layers.1.mlp.experts.gate_up_proj"] == Split(1, 2)  # [E, gate | up, hidden]
    assert plan.params["model.layers.1.mlp.experts.down_proj"] == Split(2)  # [E, hidden, I]
    assert plan.params["model.layers.1.mlp.shared_experts.down_proj.weight"] == Split(1)
    assert plan.params["model.layers.0.mlp.gate_proj.weight"] == Split(0)
    assert "model.layers.1.mlp.gate.weight" in plan.replicated  # the router
    # one all-reduce per attention block and per MLP / MoE block, one gather of the logits
    assert len(plan.reduce_outputs) == 2 * model.config.num_hidden_layers
    assert set(plan.replicated) >= {"model.embed_tokens.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                                    "model.layers.1.self_attn.kv_a_layernorm.weight"}


def test_sharding_updates_the_config_the_pool_reads():
    model = build_model("kimi-linear-tiny")
    _, (shard, _) = _ranks(model)
    from unimem_compile.hf.adapters import adapter_for

    full, local = adapter_for(model), adapter_for(shard)
    assert local.kv_spec == full.kv_spec  # the latent rows stay whole
    assert local.state_spec == shard_state_spec(full.state_spec, WORLD)
    assert local.recurrent_shape == (full.recurrent_shape[0] // WORLD, *full.recurrent_shape[1:])


@pytest.mark.parametrize("name, overrides, message", [
    ("kimi-linear-tiny", {"num_attention_heads": 3, "num_key_value_heads": 3}, "MLA layer 1 has 3 attention heads"),
    ("kimi-linear-tiny", {"linear_num_heads": 3}, "KDA layer 0 has 3 heads"),
    ("deepseek-v3-tiny", {"moe_intermediate_size": 65}, "experts has intermediate_dim 65"),
    ("deepseek-v3-tiny", {"intermediate_size": 255}, "mlp has intermediate_size 255"),
])
def test_a_world_size_that_does_not_divide_is_refused(name, overrides, message):
    from transformers import AutoModelForCausalLM

    config = model_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(GeometryError, match=message + ", not a multiple of 2"):
        plan_model(model, WORLD)


def test_a_parameter_without_a_rule_is_refused():
    model = build_model("kimi-linear-tiny")
    model.model.layers[1].self_attn.extra_proj = nn.Linear(4, 4)
    with pytest.raises(UnsupportedModel, match=r"model\.layers\.1\.self_attn\.extra_proj\.weight: .* no rule"):
        plan_model(model, WORLD)


def test_lm_head_is_replicated_when_the_vocabulary_does_not_divide():
    from transformers import AutoModelForCausalLM

    config = model_config("deepseek-v3-tiny")
    config.vocab_size = 1023
    plan = plan_model(AutoModelForCausalLM.from_config(config), WORLD)
    assert "lm_head.weight" in plan.replicated and not plan.gather_outputs
    assert plan.notes == ["lm_head replicated: its 1023 outputs do not divide over 2 ranks"]


def test_tensor_parallel_without_a_process_group_is_refused_and_changes_nothing():
    model = build_model("deepseek-v3-tiny")
    shapes = {n: p.shape for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedModel, match="init_process_group"):
        unimem_compile.compile(model, max_batch_size=1, max_seq_len=16, tensor_parallel=True)
    assert {n: p.shape for n, p in model.named_parameters()} == shapes and not hasattr(model, "unimem")


def test_tensor_parallel_must_be_a_bool():
    with pytest.raises(TypeError, match="tensor_parallel must be False or True, got 'yes'"):
        CompileOptions(max_batch_size=1, max_seq_len=8, tensor_parallel="yes")


# ---------------------------------------------------------------------------------------------- sizing
def test_one_rank_holds_the_full_latent_rows_and_its_share_of_the_states():
    kv, state = geometry("kimi-linear-48b")
    local = shard_state_spec(state, 2)
    assert local.layers[0].recurrent.shape == (16, 128, 128) and local.layers[0].conv.shape == (6144, 4)
    assert local.slot_bytes == state.slot_bytes // 2  # 20 x (49,152 + 1,048,576), every section 16-aligned
    info, one = pool_info_tp(kv, state, 40 << 30, 64, 2, "kimi-linear-48b"), pool_info(kv, state, 40 << 30, 64)
    assert set(info) == set(one) | {"tp"} and info["tp"] == 2
    assert info["page_bytes"] == one["page_bytes"] and info["slot_bytes"] == local.slot_bytes
    assert info["request_4096"]["bytes_needed"] == 64 * 64 * kv.token_bytes + local.raw_bytes
    assert info["mixes"][0]["max_requests"] > one["mixes"][0]["max_requests"]
    with pytest.raises(GeometryError, match="32 heads and 12288 conv channels, which do not divide over 3"):
        shard_state_spec(state, 3)


def test_pool_info_cli_takes_a_tensor_parallel_degree(capsys):
    assert main(["pool-info", "--tp", "4", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    kv, state = geometry("kimi-linear-48b")
    assert info == pool_info_tp(kv, state, 40 << 30, 64, 4, "kimi-linear-48b")
    assert main(["pool-info", "--tp", "3"]) == 2
    assert "do not divide over 3 ranks" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- agreement
def test_the_pool_is_deterministic_so_ranks_fed_the_same_calls_agree(gen):
    """Every rank allocates through its own pool: the same calls must give the same ids, tables and
    watermarks, refusals included (random allocations, frees and compactions on two pools)."""
    layout = ArenaLayout.for_capacity(MLASpec(2, 32, 16, torch.float32), LinearStateSpec.kda(2, 2, 8, 4, torch.float32),
                                      4, 40, 6)
    pools = [UnifiedPool(layout, "cpu", poison=False) for _ in range(2)]
    held: list[tuple[str, list[int]]] = []
    seen = {"full": 0, "moves": 0}
    for _ in range(300):
        op, n = (int(x) for x in torch.randint(0, 4, (2,), generator=gen))
        if op == 2 and not held:
            op = 3
        if op == 2:
            kind, ids = held[n % len(held)]
        outcomes = []
        for pool in pools:
            try:
                if op == 0:
                    outcomes.append(("pages", pool.alloc_pages(n + 1)))
                elif op == 1:
                    outcomes.append(("slots", pool.alloc_slots(1)))
                elif op == 2:
                    (pool.free_pages if kind == "pages" else pool.free_slots)(ids)
                    outcomes.append(("freed", ids))
                else:
                    outcomes.append(("moves", [(m.side, m.src, m.dst) for m in pool.compact()]))
            except PoolExhausted as e:
                outcomes.append(("full", e.requested, e.available))
        assert outcomes[0] == outcomes[1]
        if outcomes[0][0] in ("pages", "slots"):
            held.append(outcomes[0])
        elif op == 2:
            held.remove((kind, ids))
        seen["full"] += outcomes[0][0] == "full"
        seen["moves"] += outcomes[0][0] == "moves" and bool(outcomes[0][1])
        a, b = (pool.allocator for pool in pools)
        assert torch.equal(a.v2p, b.v2p) and torch.equal(a.s_v2p, b.s_v2p)
        assert (a.kv_watermark, a.state_watermark) == (b.kv_watermark, b.state_watermark)
    assert seen["full"] > 0 and seen["moves"] > 0  # the sequence reached a full pool and moved bytes


def test_call_digests_compare_contents_not_identities(gen):
    from unimem_compile.demo import StepClock

    ids = torch.randint(0, 100, (2, 5), generator=gen)
    a = call_digest((ids,), {"max_new_tokens": 4, "logits_processor": [StepClock(torch.device("cpu"))]})
    b = call_digest((ids.clone(),), {"logits_processor": [StepClock(torch.device("cpu"))], "max_new_tokens": 4})
    assert a == b
    assert a != call_digest((ids + 1,), {"max_new_tokens": 4, "logits_processor": [StepClock(torch.device("cpu"))]})
    assert a != call_digest((ids,), {"max_new_tokens": 5, "logits_processor": [StepClock(torch.device("cpu"))]})
    from transformers import GenerationConfig

    assert call_digest((GenerationConfig(do_sample=True),), {}) != call_digest((GenerationConfig(),), {})
    assert call_digest((GenerationConfig(top_k=5),), {}) == call_digest((GenerationConfig(top_k=5),), {})


def test_differences_name_what_differs():
    ref = {"config": {"a": 1, "b": 2}, "weights": {"w": (1.0, float("nan"))}, "model class": "X"}
    assert _differences(ref, copy.deepcopy(ref), 1) == []  # NaN digests compare equal
    other = {"config": {"a": 1, "b": 3}, "weights": {"w": (1.5, float("nan"))}, "model class": "Y"}
    assert _differences(ref, other, 1) == ["config differ in 1 entry: b (2 on rank 0, 3 on rank 1)",
                                           "weights differ in 1 entry: w",
                                           "model class differs ('X' on rank 0, 'Y' on rank 1)"]
