"""kda_state_inplace / conv_state_inplace on tiny Kimi-Linear through ``unimem_compile.compile``
(``aot_eager``): the decode graph of one KDA layer before and after the rewrites, the counts the handle
reports, and greedy fp32 tokens identical with and without the rewrites."""

import re

import pytest
import torch
from expecttest import assert_expected_inline

import unimem_compile
from unimem_compile.hf.models import build_model
from unimem_compile.passes.common import op_name, tensor_value as value

MINE = ("kda_state_inplace", "conv_state_inplace")
NEW_TOKENS = 6


def _prompt():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 1000, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on one row
    return ids, mask


def _generate(passes):
    """Compile tiny Kimi-Linear with ``passes``, generate greedily, and keep the Dynamo graphs' layer-0
    KDA nodes as printed before and after the rewrites."""
    model = build_model("kimi-linear-tiny", dtype=torch.float32)
    unimem_compile.compile(model, max_batch_size=2, max_seq_len=16, page_size=4, backend="aot_eager", passes=passes)
    manager = model.unimem.passes
    printed = []
    apply = manager.apply

    def recording_apply(gm):
        before = _layer_nodes(gm, 0)
        apply(gm)
        printed.append((before, _layer_nodes(gm, 0)))
        return gm

    manager.apply = recording_apply
    ids, mask = _prompt()
    torch._dynamo.reset()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    return model, out, printed


@pytest.fixture(scope="module")
def runs():
    return {"on": _generate(MINE), "off": _generate(False)}


_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.int64: "i64", torch.bool: "b8"}


def _short(name: str) -> str:
    """A placeholder's name without Dynamo's source prefix: ``cache_pool_arena``, ``self_attn.q_proj.weight``."""
    name = re.sub(r"^.*?_modules_layers_modules_\d+_modules_", "", name)
    name = re.sub(r"^.*?kwargs_", "", name)
    return re.sub(r"_(modules|parameters|buffers)_", ".", name).strip("_")


def _render(a, names) -> str:
    if isinstance(a, torch.fx.Node):
        return names(a)
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_render(x, names) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    if isinstance(a, slice):
        return ":".join("" if x is None else str(x) for x in (a.start, a.stop, a.step)).rstrip(":") or ":"
    if a is Ellipsis:
        return "..."
    if isinstance(a, torch.dtype):
        return _DTYPES.get(a, str(a))
    return repr(a)


def _layer_nodes(gm, layer: int) -> str:
    """The computation of ``model.layers[layer].self_attn`` in ``gm``, one node per line, named by position
    (``v0, v1...``; inputs from outside the layer ``in0, in1...``; placeholders by their short source), so
    the text depends on the graph's structure only."""
    scope = re.compile(rf"layers(\.{layer}|\[{layer}\])\.self_attn\b")
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
             and op_name(n) != "_log_api_usage_once"
             and any(scope.search(path) for path, _ in n.meta.get("nn_module_stack", {}).values())]
    local = {n: f"v{i}" for i, n in enumerate(nodes)}
    outside: dict = {}

    def names(n):
        if n in local:
            return local[n]
        if n.op == "placeholder":
            return _short(n.name)
        return outside.setdefault(n, f"in{len(outside)}")

    lines = []
    for n in nodes:
        v = value(n)
        kind = f"{_DTYPES.get(v.dtype, v.dtype)}{list(v.shape)}" if v is not None else "-"
        args = ", ".join([_render(a, names) for a in n.args]
                         + [f"{k}={_render(a, names)}" for k, a in n.kwargs.items()])
        lines.append(f"{local[n]}: {kind} = {op_name(n)}({args})")
    return "\n".join(lines)


def test_rewrites_keep_greedy_fp32_tokens_identical(runs):
    assert torch.equal(runs["on"][1], runs["off"][1])
    assert runs["on"][1].shape[1] == 7 + NEW_TOKENS


def test_handle_counts_one_replacement_per_kda_layer_in_the_decode_graph(runs):
    model = runs["on"][0]
    assert model.unimem.passes.graphs == 2  # prefill and decode
    counts = model.unimem.rewrites
    assert counts["kda_state_inplace"] == 2 and counts["conv_state_inplace"] == 2
    assert all(n == 0 for name, n in counts.items() if name not in MINE)
    assert all(n == 0 for n in runs["off"][0].unimem.rewrites.values())


def test_prefill_graph_is_left_unchanged(runs):
    before, after = runs["on"][2][0]
    assert before == after and "unimem.kda_chunk" in before


def test_decode_graph_of_one_kda_layer_before_and_after(runs):
    before, after = runs["on"][2][1]
    assert before and after
    assert_expected_inline(before, """\
v0: f32[2, 1, 128] = linear(in0, self_attn.q_proj.weight, None)
v1: f32[2, 1, 128] = linear(in0, self_attn.k_proj.weight, None)
v2: f32[2, 1, 128] = linear(in0, self_attn.v_proj.weight, None)
v3: f32[2, 1, 384] = cat([v0, v1, v2], dim=-1)
v4: f32[2, 384, 1] = transpose(v3, 1, 2)
v5: f32[2, 384, 4] = unimem.state_gather(cache_pool_arena, cache_pool_s_v2p, cache.slot_ids, 0, 45056, [384, 4], f32)
v6: f32[2, 4, 32, 32] = unimem.state_gather(cache_pool_arena, cache_pool_s_v2p, cache.slot_ids, 6144, 45056, [4, 32, 32], f32)
v7: f32[384, 4] = squeeze(self_attn.conv1d.weight, 1)
v8: f32[2, 384, 5] = cat([v5, v4], dim=-1)
v9: f32[2, 384, 5] = to(v8, f32)
v10: f32[2, 384, 4] = getitem(v9, (:, :, -4))
v11: f32[2, 384, 4] = copy_(v5, v10)
v12: f32[384, 1, 4] = unsqueeze(v7, 1)
v13: f32[2, 384, 2] = conv1d(v9, v12, None, padding=0, groups=384)
v14: f32[2, 384, 1] = getitem(v13, (:, :, -1))
v15: f32[2, 384, 1] = silu(v14)
v16: f32[2, 384, 1] = to(v15, f32)
v17: f32[2, 1, 384] = transpose(v16, 1, 2)
v18: - = split(v17, [128, 128, 128], dim=-1)
v19: f32[2, 1, 128] = getitem(v18, 0)
v20: f32[2, 1, 128] = getitem(v18, 1)
v21: f32[2, 1, 128] = getitem(v18, 2)
v22: f32[2, 1, 4, 32] = view(v19, (2, 1, -1, 32))
v23: f32[2, 1, 4, 32] = view(v20, (2, 1, -1, 32))
v24: f32[2, 1, 4, 32] = view(v21, (2, 1, -1, 32))
v25: f32[2, 1, 32] = linear(in0, self_attn.forget_gate.f_a_proj.weight, None)
v26: f32[2, 1, 128] = linear(v25, self_attn.forget_gate.f_b_proj.weight, None)
v27: f32[2, 1, 128] = float(v26)
v28: f32[128] = float(self_attn.forget_gate.dt_bias)
v29: f32[1, 1, 128] = view(v28, 1, 1, -1)
v30: f32[2, 1, 128] = add(v27, v29)
v31: f32[2, 1, 4, 32] = view(v30, (2, 1, -1, 32))
v32: f32[1, 1, 4, 1] = float(self_attn.forget_gate.a_log)
v33: f32[1, 1, 4, 1] = exp(v32)
v34: b8[2, 1, 4, 32] = gt(v31, 20.0)
v35: f32[2, 1, 4, 32] = exp(v31)
v36: f32[2, 1, 4, 32] = add(1.0, v35)
v37: f32[2, 1, 4, 32] = log(v36)
v38: f32[2, 1, 4, 32] = where(v34, v31, v37)
v39: f32[1, 1, 4, 1] = neg(v33)
v40: f32[2, 1, 4, 32] = mul(v39, v38)
v41: f32[2, 1, 4] = linear(in0, self_attn.b_proj.weight, None)
v42: f32[2, 1, 4] = sigmoid(v41)
v43: f32[2, 1, 4, 32] = to(v22, f32)
v44: f32[2, 1, 4, 32] = to(v23, f32)
v45: f32[2, 1, 4, 32] = to(v24, f32)
v46: f32[2, 1, 4, 32] = to(v40, f32)
v47: f32[2, 1, 4] = to(v42, f32)
v48: f32[2, 1, 4, 32] = mul(v43, v43)
v49: f32[2, 1, 4, 1] = sum(v48, dim=-1, keepdim=True)
v50: f32[2, 1, 4, 1] = add(v49, 1e-06)
v51: f32[2, 1, 4, 1] = sqrt(v50)
v52: f32[2, 1, 4, 32] = div(v43, v51)
v53: f32[2, 1, 4, 32] = mul(v44, v44)
v54: f32[2, 1, 4, 1] = sum(v53, dim=-1, keepdim=True)
v55: f32[2, 1, 4, 1] = add(v54, 1e-06)
v56: f32[2, 1, 4, 1] = sqrt(v55)
v57: f32[2, 1, 4, 32] = div(v44, v56)
v58: f32[2, 1, 4, 32] = mul(v52, 0.17677669529663687)
v59: f32[2, 1, 4, 32] = zeros(2, 1, 4, 32, dtype=f32, device=device(type='cpu'))
v60: f32[2, 4, 32, 32] = to(v6, v45)
v61: f32[2, 4, 32] = getitem(v58, (:, 0))
v62: f32[2, 4, 32] = getitem(v57, (:, 0))
v63: f32[2, 4, 32] = getitem(v45, (:, 0))
v64: f32[2, 4, 32] = getitem(v46, (:, 0))
v65: f32[2, 4, 32, 1] = getitem(v64, (..., None))
v66: f32[2, 4, 32, 1] = exp(v65)
v67: f32[2, 4] = getitem(v47, (:, 0))
v68: f32[2, 4, 1] = getitem(v67, (..., None))
v69: f32[2, 4, 32, 32] = mul(v60, v66)
v70: f32[2, 4, 32, 1] = getitem(v62, (..., None))
v71: f32[2, 4, 32, 32] = mul(v69, v70)
v72: f32[2, 4, 32] = sum(v71, dim=-2)
v73: f32[2, 4, 32] = sub(v63, v72)
v74: f32[2, 4, 32] = mul(v73, v68)
v75: f32[2, 4, 32, 1] = unsqueeze(v62, -1)
v76: f32[2, 4, 1, 32] = unsqueeze(v74, -2)
v77: f32[2, 4, 32, 32] = mul(v75, v76)
v78: f32[2, 4, 32, 32] = add(v69, v77)
v79: f32[2, 4, 32, 1] = unsqueeze(v61, -1)
v80: f32[2, 4, 32, 32] = mul(v78, v79)
v81: f32[2, 4, 32] = sum(v80, dim=-2)
v82: - = setitem(v59, (:, 0), v81)
v83: f32[2, 1, 4, 32] = to(v59, f32)
v84: f32[2, 4, 32, 32] = to(v78, f32)
v85: f32[2, 4, 32, 32] = to(v84, f32)
v86: f32[2, 4, 32, 32] = contiguous(v85)
v87: - = unimem.state_scatter(cache_pool_arena, cache_pool_s_v2p, cache.slot_ids, v86, 6144, 45056)
v88: - = unimem.state_scatter(cache_pool_arena, cache_pool_s_v2p, cache.slot_ids, v5, 0, 45056)
v89: f32[2, 1, 32] = linear(in0, self_attn.g_a_proj.weight, None)
v90: f32[2, 1, 128] = linear(v89, self_attn.g_b_proj.weight, None)
v91: f32[2, 1, 4, 32] = view(v90, (2, 1, -1, 32))
v92: f32[2, 1, 4, 32] = to(v83, f32)
v93: f32[2, 1, 4, 32] = pow(v92, 2)
v94: f32[2, 1, 4, 1] = mean(v93, -1, keepdim=True)
v95: f32[2, 1, 4, 1] = add(v94, 1e-05)
v96: f32[2, 1, 4, 1] = rsqrt(v95)
v97: f32[2, 1, 4, 32] = mul(v92, v96)
v98: f32[32] = to(self_attn.o_norm.weight, f32)
v99: f32[2, 1, 4, 32] = mul(v98, v97)
v100: f32[2, 1, 4, 32] = to(v91, f32)
v101: f32[2, 1, 4, 32] = sigmoid(v100)
v102: f32[2, 1, 4, 32] = mul(v99, v101)
v103: f32[2, 1, 4, 32] = to(v102, f32)
v104: f32[2, 1, 128] = reshape(v103, 2, 1, -1)
v105: f32[2, 1, 256] = linear(v104, self_attn.o_proj.weight, None)""")
    assert_expected_inline(after, """\
v0: f32[2, 1, 128] = linear(in0, self_attn.q_proj.weight, None)
v1: f32[2, 1, 128] = linear(in0, self_attn.k_proj.weight, None)
v2: f32[2, 1, 128] = linear(in0, self_attn.v_proj.weight, None)
v3: f32[2, 1, 384] = cat([v0, v1, v2], dim=-1)
v4: f32[2, 384, 1] = transpose(v3, 1, 2)
v5: f32[384, 4] = squeeze(self_attn.conv1d.weight, 1)
v6: f32[2, 384] = squeeze(v4, -1)
v7: f32[2, 384] = unimem.causal_conv1d_update(v6, cache_pool_arena, cache_pool_s_v2p, cache.slot_ids, 0, 45056, v5, None, 'silu')
v8: f32[2, 384, 1] = unsqueeze(v7, -1)
v9: f32[2, 1, 384] = transpose(v8, 1, 2)
v10: - = split(v9, [128, 128, 128], dim=-1)
v11: f32[2, 1, 128] = getitem(v10, 0)
v12: f32[2, 1, 128] = getitem(v10, 1)
v13: f32[2, 1, 128] = getitem(v10, 2)
v14: f32[2, 1, 4, 32] = view(v11, (2, 1, -1, 32))
v15: f32[2, 1, 4, 32] = view(v12, (2, 1, -1, 32))
v16: f32[2, 1, 4, 32] = view(v13, (2, 1, -1, 32))
v17: f32[2, 1, 32] = linear(in0, self_attn.forget_gate.f_a_proj.weight, None)
v18: f32[2, 1, 128] = linear(v17, self_attn.forget_gate.f_b_proj.weight, None)
v19: f32[2, 1, 128] = float(v18)
v20: f32[128] = float(self_attn.forget_gate.dt_bias)
v21: f32[1, 1, 128] = view(v20, 1, 1, -1)
v22: f32[2, 1, 128] = add(v19, v21)
v23: f32[2, 1, 4, 32] = view(v22, (2, 1, -1, 32))
v24: f32[1, 1, 4, 1] = float(self_attn.forget_gate.a_log)
v25: f32[1, 1, 4, 1] = exp(v24)
v26: b8[2, 1, 4, 32] = gt(v23, 20.0)
v27: f32[2, 1, 4, 32] = exp(v23)
v28: f32[2, 1, 4, 32] = add(1.0, v27)
v29: f32[2, 1, 4, 32] = log(v28)
v30: f32[2, 1, 4, 32] = where(v26, v23, v29)
v31: f32[1, 1, 4, 1] = neg(v25)
v32: f32[2, 1, 4, 32] = mul(v31, v30)
v33: f32[2, 1, 4] = linear(in0, self_attn.b_proj.weight, None)
v34: f32[2, 1, 4] = sigmoid(v33)
v35: f32[2, 4, 32] = select(v14, 1, 0)
v36: f32[2, 4, 32] = select(v15, 1, 0)
v37: f32[2, 4, 32] = select(v16, 1, 0)
v38: f32[2, 4, 32] = select(v32, 1, 0)
v39: f32[2, 4] = select(v34, 1, 0)
v40: f32[2, 4, 32] = unimem.kda_decode(v35, v36, v37, v38, v39, cache_pool_arena, cache_pool_s_v2p, cache.slot_ids, 6144, 45056, 0.17677669529663687, True)
v41: f32[2, 1, 4, 32] = unsqueeze(v40, 1)
v42: f32[2, 1, 32] = linear(in0, self_attn.g_a_proj.weight, None)
v43: f32[2, 1, 128] = linear(v42, self_attn.g_b_proj.weight, None)
v44: f32[2, 1, 4, 32] = view(v43, (2, 1, -1, 32))
v45: f32[2, 1, 4, 32] = to(v41, f32)
v46: f32[2, 1, 4, 32] = pow(v45, 2)
v47: f32[2, 1, 4, 1] = mean(v46, -1, keepdim=True)
v48: f32[2, 1, 4, 1] = add(v47, 1e-05)
v49: f32[2, 1, 4, 1] = rsqrt(v48)
v50: f32[2, 1, 4, 32] = mul(v45, v49)
v51: f32[32] = to(self_attn.o_norm.weight, f32)
v52: f32[2, 1, 4, 32] = mul(v51, v50)
v53: f32[2, 1, 4, 32] = to(v44, f32)
v54: f32[2, 1, 4, 32] = sigmoid(v53)
v55: f32[2, 1, 4, 32] = mul(v52, v54)
v56: f32[2, 1, 4, 32] = to(v55, f32)
v57: f32[2, 1, 128] = reshape(v56, 2, 1, -1)
v58: f32[2, 1, 256] = linear(v57, self_attn.o_proj.weight, None)""")
