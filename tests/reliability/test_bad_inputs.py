"""Bad input to any op gets a specific exception whose message carries the numbers, and changes nothing.

One table of cases per failure kind (dtype, device, rank, trailing size, layout, a geometry that disagrees
with the pool, geometry outside the arena, and, under ``UNIMEM_DEBUG=1``, ids outside the live set), run
against both entry points of every op family: the ``torch.ops.unimem.*`` op (its CPU reference) and the
Triton launcher (interpreter). After each failing call the arena, the four tables, the allocator's
bookkeeping and every input tensor are byte-identical to before.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest
import torch

from unimem_compile.errors import GeometryError
from unimem_compile.ops import conv, kda, mla_decode, mla_gather, mla_prefill, mla_write, state, translate

def _geometry(w):
    return dict(layer=w.KV_LAYER, layer_num=w.L, page_size=w.PS, kv_lora_rank=w.R, qk_rope_head_dim=w.DR,
                kv_dtype=torch.float32)


def _write_args(w, norm: bool):
    # five tokens: the last three of row 0 and the first two of row 1
    loc = torch.cat([w.locations(0, w.lens[0])[-3:], w.locations(1, 2)])
    a = dict(arena=w.pool.arena, v2p=w.pool.v2p, virt_loc=loc)
    a["kv_nope_unnormed" if norm else "kv_nope"] = w.randn(loc.numel(), w.R)
    a["k_rope"] = w.randn(loc.numel(), w.DR)
    if norm:
        a.update(norm_weight=w.randn(w.R), eps=1e-6)
    return a | _geometry(w)


def _state_ids(w):
    return torch.tensor(w.slots, dtype=torch.int64)


def _kda_inputs(w, t: int | None) -> dict:
    lead = (2,) if t is None else (2, t)
    return dict(q=w.randn(*lead, w.H, w.K), k=w.randn(*lead, w.H, w.K), v=w.randn(*lead, w.H, w.V),
                g=-torch.rand(*lead, w.H, w.K, generator=w.gen) - 0.05, beta=torch.rand(*lead, w.H, generator=w.gen))


def _kda_args(w, t: int | None):
    return _kda_inputs(w, t) | dict(arena=w.pool.arena, s_v2p=w.pool.s_v2p, slot_ids=_state_ids(w),
                                    state_offset=w.recurrent_offset(), slot_bytes=w.slot_bytes, scale=w.K ** -0.5,
                                    use_qk_l2norm=True)


def _prefill_args(w):
    # 3 queries per row (row 1 holds 3 tokens: no pad), qk_nope 8 + rope, v 8; 4-token pieces: three of them
    dn = dv = 8
    return (dict(q=w.randn(2, w.H, 3, dn + w.DR), arena=w.pool.arena, v2p=w.pool.v2p, page_table=w.page_table,
                 kv_len=w.kv_len, kv_len_host=w.kv_len.cpu(), w_kv_b=w.randn(w.H * (dn + dv), w.R), sm_scale=0.2,
                 workspace_tokens=4) | _geometry(w))


@dataclasses.dataclass(frozen=True)
class Family:
    op: Callable
    launcher: Callable | None
    build: Callable  # World -> dict of arguments in the op's order


FAMILIES = {
    "translate_kv_loc_dense": Family(
        torch.ops.unimem.translate_kv_loc_dense, translate.translate_kv_loc_dense_triton,
        lambda w: dict(v2p=w.pool.v2p, virt=w.locations(0, w.lens[0]), page_size=w.PS, kernel_page_multiplier=w.L)),
    "translate_kv_loc_dense_out": Family(
        torch.ops.unimem.translate_kv_loc_dense_out, translate.translate_kv_loc_dense_triton,
        lambda w: dict(v2p=w.pool.v2p, virt=w.locations(0, w.lens[0]), page_size=w.PS, kernel_page_multiplier=w.L,
                       out=torch.full((w.lens[0],), 7, dtype=torch.int64))),
    "mla_kv_write": Family(torch.ops.unimem.mla_kv_write, mla_write.mla_kv_write_triton,
                           lambda w: _write_args(w, norm=False)),
    "mla_kv_write_rmsnorm": Family(torch.ops.unimem.mla_kv_write_rmsnorm, mla_write.mla_kv_write_rmsnorm_triton,
                                   lambda w: _write_args(w, norm=True)),
    "mla_gather": Family(
        torch.ops.unimem.mla_gather, mla_gather.mla_gather_triton,
        lambda w: dict(arena=w.pool.arena, v2p=w.pool.v2p, page_table=w.page_table, kv_len=w.kv_len,
                       out_offset=torch.tensor([0, 2], dtype=torch.int32), max_len=10) | _geometry(w)),
    "mla_decode": Family(
        torch.ops.unimem.mla_decode, mla_decode.mla_decode_triton,
        lambda w: dict(q_nope=w.randn(2, w.H, w.R), q_rope=w.randn(2, w.H, w.DR), arena=w.pool.arena, v2p=w.pool.v2p,
                       page_table=w.page_table, kv_len=w.kv_len, sm_scale=0.2) | _geometry(w)),
    "mla_prefill": Family(torch.ops.unimem.mla_prefill, mla_prefill.mla_prefill_triton, _prefill_args),
    "state_gather": Family(
        torch.ops.unimem.state_gather, state.state_gather_triton,
        lambda w: dict(arena=w.pool.arena, s_v2p=w.pool.s_v2p, slot_ids=_state_ids(w), byte_offset=w.recurrent_offset(),
                       slot_bytes=w.slot_bytes, shape=[w.H, w.K, w.V], dtype=torch.float32)),
    "state_scatter": Family(
        torch.ops.unimem.state_scatter, state.state_scatter_triton,
        lambda w: dict(arena=w.pool.arena, s_v2p=w.pool.s_v2p, slot_ids=_state_ids(w), value=w.randn(2, w.H, w.K, w.V),
                       byte_offset=w.recurrent_offset(), slot_bytes=w.slot_bytes)),
    "causal_conv1d_update": Family(
        torch.ops.unimem.causal_conv1d_update, conv.causal_conv1d_update_triton,
        lambda w: dict(x=w.randn(2, w.C), arena=w.pool.arena, s_v2p=w.pool.s_v2p, slot_ids=_state_ids(w),
                       conv_offset=w.conv_offset(), slot_bytes=w.slot_bytes, weight=w.randn(w.C, w.CONV_K),
                       bias=w.randn(w.C), activation="silu")),
    "kda_decode": Family(torch.ops.unimem.kda_decode, kda.kda_decode_triton, lambda w: _kda_args(w, None)),
    "kda_prefill": Family(torch.ops.unimem.kda_prefill, kda.kda_prefill_cuda, lambda w: _kda_args(w, 3)),
    "kda_chunk": Family(
        torch.ops.unimem.kda_chunk, None,
        lambda w: _kda_inputs(w, 3) | dict(initial_state=w.randn(2, w.H, w.K, w.V), scale=w.K ** -0.5,
                                           use_qk_l2norm=True)),
}
MLA = ["mla_kv_write", "mla_kv_write_rmsnorm", "mla_gather", "mla_decode", "mla_prefill"]
SLOTS = ["state_gather", "state_scatter", "causal_conv1d_update", "kda_decode", "kda_prefill"]


def build_args(family: str, w) -> dict:
    return FAMILIES[family].build(w)


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    label: str
    mutate: Callable  # (world, args) -> None, edits args in place
    exc: type
    pattern: Callable | str  # regex, or (world, args after mutate) -> regex
    debug: bool = False

    @property
    def id(self) -> str:
        return f"{self.family}-{self.label}"


def _n(family: str) -> str:
    """The op name a message starts with (the out variant's launcher reports the plain name)."""
    return "translate_kv_loc_dense(?:_out)?" if family == "translate_kv_loc_dense_out" else family


def _set(name, make):
    def mutate(w, a):
        a[name] = make(w, a)
    return mutate


def _shape_text(shape) -> str:
    """The numbers of a shape as messages print it (``(1, 7)`` or ``[1, 7]``)."""
    return r"[\[(]" + r",\s*".join(str(int(d)) for d in shape)


# ------------------------------------------------------------------------------------------ case tables
_KDA_TENSORS = ["q", "k", "v", "g", "beta", "arena", "s_v2p", "slot_ids"]
#: the tensor arguments of each family (test_tensor_argument_lists_match_the_builders keeps this honest)
TENSOR_ARGS = {
    "translate_kv_loc_dense": ["v2p", "virt"], "translate_kv_loc_dense_out": ["v2p", "virt", "out"],
    "mla_kv_write": ["arena", "v2p", "virt_loc", "kv_nope", "k_rope"],
    "mla_kv_write_rmsnorm": ["arena", "v2p", "virt_loc", "kv_nope_unnormed", "k_rope", "norm_weight"],
    "mla_gather": ["arena", "v2p", "page_table", "kv_len", "out_offset"],
    "mla_decode": ["q_nope", "q_rope", "arena", "v2p", "page_table", "kv_len"],
    "mla_prefill": ["q", "arena", "v2p", "page_table", "kv_len", "kv_len_host", "w_kv_b"],
    "state_gather": ["arena", "s_v2p", "slot_ids"], "state_scatter": ["arena", "s_v2p", "slot_ids", "value"],
    "causal_conv1d_update": ["x", "arena", "s_v2p", "slot_ids", "weight", "bias"],
    "kda_decode": _KDA_TENSORS, "kda_prefill": _KDA_TENSORS,
    "kda_chunk": ["q", "k", "v", "g", "beta", "initial_state"],
}
WRONG_DTYPE = {torch.int64: torch.int32, torch.int32: torch.int64, torch.uint8: torch.int8,
               torch.float32: torch.float64}


def dtype_cases():
    """Every tensor argument of every family in a dtype the op does not take (state_scatter's value may have
    any dtype: it is the section's)."""
    for family, names in TENSOR_ARGS.items():
        for name in names:
            if (family, name) == ("state_scatter", "value"):
                continue
            yield Case(family, f"{name}_dtype", _set(name, lambda w, a, n=name: a[n].to(WRONG_DTYPE[a[n].dtype])),
                       TypeError, lambda w, a, n=name, f=family: rf"{_n(f)}: {n} must be .*got {re.escape(str(a[n].dtype))}")


def device_cases():
    """Every tensor argument of every family on a second device (meta) while the others are on the CPU
    (mla_prefill's kv_len_host is the host copy of kv_len: it must be on the CPU whatever the others)."""
    for family, names in TENSOR_ARGS.items():
        for name in names:
            if (family, name) == ("mla_prefill", "kv_len_host"):
                yield Case(family, f"{name}_on_meta", _set(name, lambda w, a: a["kv_len_host"].to("meta")), ValueError,
                           r"mla_prefill: kv_len_host must be a CPU tensor \(the host copy of kv_len\), got meta")
                continue
            yield Case(family, f"{name}_on_meta", _set(name, lambda w, a, n=name: a[n].to("meta")), ValueError,
                       rf"{_n(family)}: (?:{name} is on meta but \w+ is on cpu|\w+ is on cpu but {name} is on meta)")


# tensors whose rank is fixed (state_scatter's value and the translation's virt take any rank)
FIXED_RANK = {
    "translate_kv_loc_dense": ["v2p"], "translate_kv_loc_dense_out": ["v2p", "out"],
    "mla_kv_write": ["arena", "v2p", "virt_loc", "kv_nope", "k_rope"],
    "mla_kv_write_rmsnorm": ["virt_loc", "kv_nope_unnormed", "k_rope", "norm_weight"],
    "mla_gather": ["arena", "v2p", "page_table", "kv_len", "out_offset"],
    "mla_decode": ["q_nope", "q_rope", "page_table", "kv_len"],
    "mla_prefill": ["q", "arena", "v2p", "page_table", "kv_len", "kv_len_host", "w_kv_b"],
    "state_gather": ["arena", "s_v2p", "slot_ids"], "state_scatter": ["s_v2p", "slot_ids"],
    "causal_conv1d_update": ["x", "weight", "bias", "slot_ids"],
    "kda_decode": ["q", "k", "v", "g", "beta", "slot_ids"], "kda_prefill": ["q", "k", "v", "g", "beta"],
    "kda_chunk": ["q", "k", "v", "g", "beta", "initial_state"],
}


def rank_cases():
    for family, names in FIXED_RANK.items():
        for name in names:
            yield Case(family, f"{name}_rank", _set(name, lambda w, a, n=name: a[n].unsqueeze(0)), GeometryError,
                       lambda w, a, n=name, f=family: rf"{_n(f)}: {n} must have .*got (?:shape )?{_shape_text(a[n].shape)}")


def _shrink_last(name, by=-1):
    def make(w, a):
        t = a[name]
        return t.new_ones(*t.shape[:-1], t.shape[-1] + by)
    return _set(name, make)


def _shapes_pattern(family, name, want):
    return lambda w, a: rf"{_n(family)}: {name} must have shape \[{', '.join(map(str, want(w)))}\], got \[" + \
        ", ".join(map(str, a[name].shape)) + r"\]"


TRAILING = [
    Case("translate_kv_loc_dense_out", "out_short", _shrink_last("out"), GeometryError,
         _shapes_pattern("translate_kv_loc_dense_out", "out", lambda w: [w.lens[0]])),
    Case("mla_kv_write", "kv_nope_short", _shrink_last("kv_nope"), GeometryError,
         _shapes_pattern("mla_kv_write", "kv_nope", lambda w: [5, w.R])),
    Case("mla_kv_write", "k_rope_long", _shrink_last("k_rope", +1), GeometryError,
         _shapes_pattern("mla_kv_write", "k_rope", lambda w: [5, w.DR])),
    Case("mla_kv_write_rmsnorm", "kv_nope_long", _shrink_last("kv_nope_unnormed", +1), GeometryError,
         _shapes_pattern("mla_kv_write_rmsnorm", "kv_nope_unnormed", lambda w: [5, w.R])),
    Case("mla_kv_write_rmsnorm", "norm_weight_short", _shrink_last("norm_weight"), GeometryError,
         _shapes_pattern("mla_kv_write_rmsnorm", "norm_weight", lambda w: [w.R])),
    Case("mla_gather", "kv_len_extra_row", _shrink_last("kv_len", +1), GeometryError,
         _shapes_pattern("mla_gather", "kv_len", lambda w: [2])),
    Case("mla_decode", "q_nope_short", _shrink_last("q_nope"), GeometryError,
         _shapes_pattern("mla_decode", "q_nope", lambda w: [2, w.H, w.R])),
    Case("mla_decode", "q_rope_long", _shrink_last("q_rope", +1), GeometryError,
         _shapes_pattern("mla_decode", "q_rope", lambda w: [2, w.H, w.DR])),
    Case("mla_decode", "kv_len_short", _shrink_last("kv_len"), GeometryError,
         _shapes_pattern("mla_decode", "kv_len", lambda w: [2])),
    Case("mla_prefill", "w_kv_b_narrow", _shrink_last("w_kv_b"), GeometryError,
         lambda w, a: rf"mla_prefill: w_kv_b must have shape \[\*, {w.R}\], got \[{a['w_kv_b'].shape[0]}, {w.R - 1}\]"),
    Case("mla_prefill", "w_kv_b_rows", _set("w_kv_b", lambda w, a: w.randn(w.H * 8, w.R)), GeometryError,
         lambda w, a: rf"mla_prefill: w_kv_b has {w.H * 8} rows, not heads {w.H} x \(qk_nope_head_dim 8 \+ v_head_dim\)"),
    Case("mla_prefill", "kv_len_host_short", _shrink_last("kv_len_host"), GeometryError,
         _shapes_pattern("mla_prefill", "kv_len_host", lambda w: [2])),
    Case("mla_prefill", "q_no_nope_part", _set("q", lambda w, a: a["q"][..., :w.DR]), GeometryError,
         lambda w, a: rf"mla_prefill: q's last dimension {w.DR} must be qk_nope_head_dim \+ qk_rope_head_dim"),
    Case("mla_prefill", "workspace_zero", _set("workspace_tokens", lambda w, a: 0), ValueError,
         r"mla_prefill: workspace_tokens must be an int >= 1, got 0"),
    Case("state_gather", "section_past_the_slot",
         _set("shape", lambda w, a: [w.H, w.K, w.slot_bytes // (w.H * w.K * 4)]), GeometryError,
         lambda w, a: rf"state_gather: the section \[{w.recurrent_offset()}, "
                      rf"{w.recurrent_offset() + 4 * w.H * w.K * a['shape'][-1]}\) does not fit in a slot of "
                      rf"{w.slot_bytes} bytes"),
    Case("state_scatter", "value_past_the_slot",
         _set("value", lambda w, a: w.randn(2, w.H, w.K, w.slot_bytes // (w.H * w.K * 4))), GeometryError,
         lambda w, a: rf"state_scatter: the section \[{w.recurrent_offset()}, "
                      rf"{w.recurrent_offset() + a['value'][0].numel() * 4}\) does not fit in a slot of {w.slot_bytes}"),
    Case("state_scatter", "value_batch_mismatch", _set("value", lambda w, a: w.randn(3, w.H, w.K, w.V)), ValueError,
         r"state_scatter: slot_ids has 2 lanes but the inputs have batch 3"),
    Case("causal_conv1d_update", "weight_channels", _set("weight", lambda w, a: w.randn(w.C - 1, w.CONV_K)),
         ValueError, lambda w, a: rf"causal_conv1d_update: weight must be \[C={w.C}, kernel\], got \[{w.C - 1}, {w.CONV_K}\]"),
    Case("causal_conv1d_update", "bias_long", _shrink_last("bias", +1), GeometryError,
         _shapes_pattern("causal_conv1d_update", "bias", lambda w: [w.C])),
    Case("kda_decode", "k_short", _shrink_last("k"), GeometryError,
         _shapes_pattern("kda_decode", "k", lambda w: [2, w.H, w.K])),
    Case("kda_decode", "g_short", _shrink_last("g"), GeometryError,
         _shapes_pattern("kda_decode", "g", lambda w: [2, w.H, w.K])),
    Case("kda_decode", "beta_extra_head", _shrink_last("beta", +1), GeometryError,
         _shapes_pattern("kda_decode", "beta", lambda w: [2, w.H])),
    Case("kda_prefill", "v_heads", _set("v", lambda w, a: w.randn(2, 3, w.H + 1, w.V)), GeometryError,
         lambda w, a: rf"kda_prefill: v must have shape \[2, 3, {w.H}, \*\], got \[2, 3, {w.H + 1}, {w.V}\]"),
    Case("kda_prefill", "q_k_disagree", _shrink_last("k", +1), GeometryError,
         _shapes_pattern("kda_prefill", "k", lambda w: [2, 3, w.H, w.K])),
    Case("kda_chunk", "initial_state_v", _shrink_last("initial_state", +1), GeometryError,
         _shapes_pattern("kda_chunk", "initial_state", lambda w: [2, w.H, w.K, w.V])),
    Case("kda_chunk", "g_short", _shrink_last("g"), GeometryError,
         _shapes_pattern("kda_chunk", "g", lambda w: [2, 3, w.H, w.K])),
]


def _strided_copy(name):
    """The same values in a tensor whose elements are two apart (non-contiguous)."""
    def make(w, a):
        t = a[name]
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    return _set(name, make)


LAYOUT = [
    Case(f, f"{name}_strided", _strided_copy(name), GeometryError, rf"{_n(f)}: {name} must be contiguous, got strides \(2,\)")
    for f, names in {
        "translate_kv_loc_dense": ["v2p"], "mla_kv_write": ["arena", "v2p"], "mla_kv_write_rmsnorm": ["v2p"],
        "mla_gather": ["arena", "v2p"], "mla_decode": ["arena", "v2p"], "mla_prefill": ["arena", "v2p"],
        "state_gather": ["arena", "s_v2p"],
        "state_scatter": ["arena", "s_v2p"], "causal_conv1d_update": ["s_v2p"], "kda_decode": ["arena", "s_v2p"],
        "kda_prefill": ["s_v2p"],
    }.items() for name in names
]


def _pool_mismatch(family, label, change, detail):
    """A geometry tail that disagrees with the pool the arena and v2p come from."""
    def pattern(w, a):
        pb = a["page_size"] * a["layer_num"] * (w.R + w.DR) * torch.empty((), dtype=a["kv_dtype"]).element_size()
        holds = w.pool.arena.numel() // pb - 1
        return (rf"{_n(family)}: an arena of {w.pool.arena.numel()} bytes holds {holds} pages of {pb} bytes "
                rf"\({detail(a)}\) plus the tail pad, but v2p has {w.pool.v2p.numel()} entries: the geometry "
                rf"disagrees with the pool")
    return Case(family, label, change, GeometryError, pattern)


def mismatch_cases():
    detail = lambda a: (rf"page_size {a['page_size']}, layer_num {a['layer_num']}, kv_lora_rank {a['kv_lora_rank']}, "  # noqa: E731
                        rf"qk_rope_head_dim {a['qk_rope_head_dim']}, {re.escape(str(a['kv_dtype']))}")
    for family in MLA:
        yield _pool_mismatch(family, "half_page_size", _set("page_size", lambda w, a: w.PS // 2), detail)
        yield _pool_mismatch(family, "kv_dtype_fp16", _set("kv_dtype", lambda w, a: torch.float16), detail)

        def fewer_layers(w, a):
            a["layer_num"], a["layer"] = w.L - 1, 0
        yield _pool_mismatch(family, "fewer_layers", fewer_layers, detail)
        yield Case(family, "double_page_size", _set("page_size", lambda w, a: 2 * w.PS), GeometryError,
                   lambda w, a, f=family: rf"{_n(f)}: {w.pool.v2p.numel()} pages of {2 * w.PS * w.L * (w.R + w.DR) * 4} "
                                          rf"bytes plus the tail pad need \d+ arena bytes, the arena has "
                                          rf"{w.pool.arena.numel()}")


def geometry_cases():
    for family in MLA:
        for label, layer in (("layer_negative", lambda w: -1), ("layer_L", lambda w: w.L)):
            yield Case(family, label, _set("layer", lambda w, a, x=layer: x(w)), GeometryError,
                       lambda w, a, f=family: rf"{_n(f)}: layer {a['layer']} is outside \[0, {w.L}\)")
    offsets = {"state_gather": "byte_offset", "state_scatter": "byte_offset", "causal_conv1d_update": "conv_offset",
               "kda_decode": "state_offset", "kda_prefill": "state_offset"}
    for family, off in offsets.items():
        yield Case(family, "offset_misaligned", _set(off, lambda w, a, o=off: a[o] + 4), GeometryError,
                   lambda w, a, f=family, o=off: rf"{_n(f)}: byte_offset must be a non-negative multiple of 16, got {a[o]}")
        yield Case(family, "offset_past_the_slot", _set(off, lambda w, a: w.slot_bytes), GeometryError,
                   lambda w, a, f=family: rf"{_n(f)}: the section \[{w.slot_bytes}, \d+\) does not fit in a slot of "
                                          rf"{w.slot_bytes} bytes")
        yield Case(family, "pitch_past_the_arena", _set("slot_bytes", lambda w, a: 2 * w.slot_bytes), GeometryError,
                   lambda w, a, f=family: rf"{_n(f)}: {w.pool.s_v2p.numel()} slots of {2 * w.slot_bytes} bytes need "
                                          rf"{2 * w.slot_bytes * w.pool.s_v2p.numel()} arena bytes, the arena has "
                                          rf"{w.pool.arena.numel()}")
        yield Case(family, "pitch_misaligned", _set("slot_bytes", lambda w, a: w.slot_bytes - 8), GeometryError,
                   lambda w, a, f=family: rf"{_n(f)}: slot_bytes must be a positive multiple of 16, got {w.slot_bytes - 8}")


# ---- UNIMEM_DEBUG=1: ids checked against the live set
def _location_case(family, key, label, where):
    """Replace lane 1 of the location tensor ``key`` by ``where(w)``; the message names lane and location."""
    def mutate(w, a):
        a[key] = a[key].clone()
        a[key][1] = where(w)
    return Case(family, label, mutate, GeometryError,
                lambda w, a: rf"{_n(family)}: 1 locations are not on live pages: lane 1: location {int(a[key][1])} "
                             rf"\(virtual page {int(a[key][1]) // w.PS}\)", debug=True)


def _slot_case(family, label, make_ids, exc, pattern):
    return Case(family, label, _set("slot_ids", lambda w, a: torch.tensor(make_ids(w), dtype=torch.int64)), exc,
                pattern, debug=True)


def debug_cases():
    where = {"dead_page": lambda w: w.dead_page * w.PS + 1, "virtual_page_0": lambda w: 2,
             "past_the_table": lambda w: w.pool.v2p.numel() * w.PS + 1}
    for label, fn in where.items():
        yield _location_case("translate_kv_loc_dense", "virt", label, fn)
        yield _location_case("mla_kv_write", "virt_loc", label, fn)
        yield _location_case("mla_kv_write_rmsnorm", "virt_loc", label, fn)

    def dead_column(w, a):
        a["page_table"] = a["page_table"].clone()
        a["page_table"][0, 1] = w.dead_page
    yield Case("mla_gather", "dead_page_inside_kv_len", dead_column, GeometryError,
               lambda w, a: rf"mla_gather: 1 pages inside kv_len are not live: row 0 page slot 1: virtual page "
                            rf"{w.dead_page}", debug=True)
    yield Case("mla_decode", "dead_page_inside_kv_len", dead_column, GeometryError,
               lambda w, a: rf"mla_decode: 1 pages inside kv_len are not live: row 0 page slot 1: virtual page "
                            rf"{w.dead_page}", debug=True)
    yield Case("mla_prefill", "dead_page_inside_kv_len", dead_column, GeometryError,
               lambda w, a: rf"mla_prefill: 1 pages inside kv_len are not live: row 0 page slot 1: virtual page "
                            rf"{w.dead_page}", debug=True)
    yield Case("mla_prefill", "stale_host_lengths",
               _set("kv_len_host", lambda w, a: torch.tensor([w.lens[0], w.lens[1] - 1], dtype=torch.int32)),
               GeometryError, lambda w, a: rf"mla_prefill: kv_len_host disagrees with kv_len: row 1: kv_len "
                                           rf"{w.lens[1]}, kv_len_host {w.lens[1] - 1}", debug=True)
    yield Case("mla_gather", "history_past_max_len", _set("max_len", lambda w, a: w.lens[0] - 1), GeometryError,
               lambda w, a: rf"mla_gather: histories do not fit in max_len {w.lens[0] - 1}: row 0: out_offset 0 \+ "
                            rf"kv_len {w.lens[0]}", debug=True)
    # row 1 has one page: one token more needs a second, whose entry is -1
    yield Case("mla_gather", "hole_inside_kv_len",
               _set("kv_len", lambda w, a: torch.tensor([w.lens[0], w.PS + 1], dtype=torch.int32)),
               GeometryError, r"mla_gather: page_table entries are -1 inside kv_len: row 1 page 1", debug=True)
    yield Case("mla_decode", "kv_len_past_the_table",
               _set("kv_len", lambda w, a: torch.tensor([w.lens[0], 3 * w.PS + 1], dtype=torch.int32)), GeometryError,
               lambda w, a: rf"mla_decode: kv_len\[1\] = {3 * w.PS + 1} is outside \[0, 3 pages x {w.PS} tokens\]",
               debug=True)
    for family in SLOTS:
        yield _slot_case(family, "dead_slot", lambda w: [w.slots[0], w.dead_slot], GeometryError,
                         lambda w, a, f=family: rf"{_n(f)}: 1 slot ids are not live: lane 1: slot {w.dead_slot}")
        yield _slot_case(family, "slot_0", lambda w: [0, w.slots[1]], GeometryError,
                         rf"{_n(family)}: 1 slot ids are not live: lane 0: slot 0")
        yield _slot_case(family, "slot_past_the_table", lambda w: [w.slots[0], w.pool.s_v2p.numel()], GeometryError,
                         lambda w, a, f=family: rf"{_n(f)}: 1 slot ids are not live: lane 1: slot {w.pool.s_v2p.numel()}")
        yield _slot_case(family, "repeated_slot", lambda w: [w.slots[1], w.slots[1]], ValueError,
                         lambda w, a, f=family: rf"{_n(f)}: slot ids \[{w.slots[1]}\] appear in more than one lane")


CASES = [*dtype_cases(), *device_cases(), *rank_cases(), *TRAILING, *LAYOUT, *mismatch_cases(), *geometry_cases(),
         *debug_cases()]


def _entry_points(family: str):
    fam = FAMILIES[family]
    return [("op", fam.op)] + ([("launcher", fam.launcher)] if fam.launcher is not None else [])


def _call(fn, args: dict):
    if fn is translate.translate_kv_loc_dense_triton and "out" in args:
        return fn(*list(args.values())[:4], out=args["out"])
    return fn(*args.values())


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_with_the_numbers_and_changes_nothing(case, world, monkeypatch):
    if case.debug:
        monkeypatch.setenv("UNIMEM_DEBUG", "1")
    for entry, fn in _entry_points(case.family):
        args = build_args(case.family, world)
        case.mutate(world, args)
        pattern = case.pattern(world, args) if callable(case.pattern) else case.pattern
        inputs = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
        before = world.snapshot()
        with pytest.raises(case.exc, match=pattern):
            _call(fn, args)
        world.assert_unchanged(before)
        for name, was in inputs.items():
            assert torch.equal(args[name], was), f"{entry}: input {name} changed"


#: per-call inputs a launcher copies when they are not contiguous (tables and the arena must be: see LAYOUT)
COPIED = [("translate_kv_loc_dense", "virt"), ("mla_kv_write", "virt_loc"), ("mla_gather", "page_table"),
          ("mla_gather", "kv_len"), ("mla_decode", "page_table"), ("mla_decode", "kv_len"), ("mla_prefill", "q"),
          ("mla_prefill", "page_table"), ("mla_prefill", "kv_len"),
          ("state_gather", "slot_ids"), ("state_scatter", "slot_ids"), ("causal_conv1d_update", "slot_ids"),
          ("causal_conv1d_update", "bias"), ("kda_decode", "slot_ids"), ("kda_decode", "beta"),
          ("kda_prefill", "slot_ids")]


@pytest.mark.parametrize("family,name", COPIED, ids=[f"{f}-{n}" for f, n in COPIED])
def test_launchers_read_strided_per_call_inputs_like_contiguous_ones(family, name, make_world):
    """The same values in a strided tensor give bit-identical results and arena bytes."""
    outs = []
    for strided in (False, True):
        w = make_world()
        args = build_args(family, w)
        if strided:
            _strided_copy(name)(w, args)
            assert not args[name].is_contiguous()
        outs.append((_call(FAMILIES[family].launcher, args), w.pool.arena.clone()))
    (want, want_arena), (got, got_arena) = outs
    assert torch.equal(got_arena, want_arena)
    assert (want is None and got is None) or torch.equal(got, want)


def test_tensor_argument_lists_match_the_builders(world):
    for family in FAMILIES:
        tensors = [k for k, v in build_args(family, world).items() if isinstance(v, torch.Tensor)]
        assert tensors == TENSOR_ARGS[family], family


def test_every_family_has_a_case_of_every_kind():
    for kind in (dtype_cases, device_cases, rank_cases):
        assert {c.family for c in kind()} == set(FAMILIES), kind.__name__
    # ids are checked against the live set by every family that takes ids into the arena
    assert {c.family for c in debug_cases()} == set(FAMILIES) - {"kda_chunk", "translate_kv_loc_dense_out"}
