"""Op ``unimem::causal_conv1d_update``: one decode step of a short causal depthwise convolution whose state
lives in an arena slot and is updated in place.

The math is transformers' Kimi-Linear ``causal_conv1d_update`` (``models/kimi_linear/modeling_kimi_linear.py``)
for one token: the conv state ``[C, K]`` keeps the last K (not K-1) raw input columns in the model dtype
(the dtype of ``x``); ``new = cat(state, x)`` cast to the weight's dtype; the state becomes the last K
columns of ``new``; the output is the depthwise convolution of those K columns with ``weight [C, K]`` plus
``bias``, then the activation (SiLU for ``"silu"``/``"swish"``), cast to ``x``'s dtype. transformers passes
``x`` as ``[B, C, 1]``; this op takes ``[B, C]``.

Slots are addressed as in :mod:`unimem_compile.ops.state` (virtual id -> ``s_v2p`` -> pitch ``slot_bytes``,
int64 bytes); a masked lane convolves a zero state and writes nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import (FLOAT_INPUT_DTYPES, check_same_device, check_slot_geometry, check_slot_ids, check_tensor,
                     declare_slot_footprint, typed_arena)
from .state import gather_sections, scatter_sections

__all__ = ["causal_conv1d_update", "causal_conv1d_update_triton", "causal_conv1d_step", "ACTIVATIONS"]

#: Activation names the op accepts (None = identity); both names mean SiLU, as in transformers' ACT2FN.
ACTIVATIONS = (None, "silu", "swish")


def causal_conv1d_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of one step on plain tensors.

    Args:
        x: ``[B, C]``, the new raw column. state: ``[B, C, K]`` in ``x``'s dtype (not modified).
        weight: ``[C, K]``. bias: ``[C]`` or None. activation: one of :data:`ACTIVATIONS`.

    Returns:
        ``(out [B, C] in x's dtype, new_state [B, C, K] in state's dtype)``.
    """
    new = torch.cat([state, x.unsqueeze(-1)], dim=-1).to(weight.dtype)[..., 1:]
    out = (new.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    out = out.to(weight.dtype)
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype), new.to(state.dtype)


# ---------------------------------------------------------------------------- Triton kernel
@triton.jit
def _conv_update_kernel(x_ptr, stride_xb, arena_ptr, s_v2p_ptr, slot_ptr, w_ptr, bias_ptr, out_ptr,
                        num_slots, slot_elems, offset_elems, C, K: tl.constexpr,
                        BC: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    # program (lane, channel block) owns BC channels x all K taps of one lane: it reads the state's last
    # K-1 columns and x, writes the shifted state back and computes its BC outputs; blocks never overlap
    lane = tl.program_id(0).to(tl.int64)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    tap = tl.arange(0, BK)
    in_c = rc < C
    sid = tl.load(slot_ptr + lane)
    ok = (sid >= 0) & (sid < num_slots)
    phys = tl.load(s_v2p_ptr + tl.where(ok, sid, 0), mask=ok, other=-1)  # masked before indexing the table
    ok = ok & (phys > 0)
    # arena_ptr is the arena typed as x's dtype, the conv state's dtype; offsets are in elements
    state_ptr = arena_ptr + (tl.where(ok, phys, 0) * slot_elems + offset_elems)
    # a masked lane sees zero channels of state (a scalar `ok` in a vector mask is mis-typed by the interpreter)
    live_c = rc < tl.where(ok, C, 0)
    cell = rc[:, None].to(tl.int64) * K + tap[None, :]
    x = tl.load(x_ptr + lane * stride_xb + rc, mask=in_c, other=0)
    # new column j is old column j+1, and x for j = K-1
    shifted = tl.load(state_ptr + cell + 1, mask=live_c[:, None] & (tap[None, :] < K - 1), other=0)
    new = tl.where(tap[None, :] == K - 1, x[:, None], shifted)
    w = tl.load(w_ptr + cell, mask=in_c[:, None] & (tap[None, :] < K), other=0)
    new = new.to(w.dtype)  # transformers casts cat(state, x) to the weight dtype before storing and convolving
    tl.store(state_ptr + cell, new.to(x.dtype), mask=live_c[:, None] & (tap[None, :] < K))
    acc = tl.sum(new.to(tl.float32) * w.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rc, mask=in_c, other=0).to(tl.float32)
    acc = acc.to(w.dtype).to(tl.float32)  # F.conv1d rounds its result to the weight dtype
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + lane * C + rc, acc.to(w.dtype).to(out_ptr.dtype.element_ty), mask=in_c)


def _check(op, x, arena, s_v2p, slot_ids, conv_offset, slot_bytes, weight, bias, activation) -> None:
    check_tensor(op, "x", x, dtype=FLOAT_INPUT_DTYPES, dim=2)
    b, c = x.shape
    check_tensor(op, "weight", weight, dtype=FLOAT_INPUT_DTYPES, dim=2)
    if weight.shape[0] != c:
        raise ValueError(f"{op}: weight must be [C={c}, kernel], got {list(weight.shape)}")
    if weight.shape[1] < 1:
        raise ValueError(f"{op}: the kernel width must be positive, got weight {list(weight.shape)}")
    if bias is not None:
        check_tensor(op, "bias", bias, dtype=FLOAT_INPUT_DTYPES, shape=(c,))
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    nbytes = c * weight.shape[1] * x.element_size()
    check_slot_geometry(op, arena, s_v2p, conv_offset, nbytes, slot_bytes)
    check_same_device(op, x=x, arena=arena, s_v2p=s_v2p, slot_ids=slot_ids, weight=weight, bias=bias)
    check_slot_ids(op, s_v2p, slot_ids, b)


def causal_conv1d_update_triton(x: torch.Tensor, arena: torch.Tensor, s_v2p: torch.Tensor, slot_ids: torch.Tensor,
                                conv_offset: int, slot_bytes: int, weight: torch.Tensor,
                                bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """Triton launcher of :func:`causal_conv1d_update`; one program per (lane, block of 128 channels).

    ``x`` may have any row stride (a column slice of a wider projection); a last-dimension stride other
    than 1 and a non-contiguous weight, bias or slot_ids are copied.
    """
    op = "causal_conv1d_update"
    _check(op, x, arena, s_v2p, slot_ids, conv_offset, slot_bytes, weight, bias, activation)
    if x.stride(1) != 1:
        x = x.contiguous()
    weight, slot_ids = weight.contiguous(), slot_ids.contiguous()
    bias = None if bias is None else bias.contiguous()
    b, c = x.shape
    kernel = weight.shape[1]
    out = torch.empty((b, c), dtype=x.dtype, device=x.device)
    if b == 0:
        return out
    block_c = min(128, triton.next_power_of_2(c))
    grid = (b, triton.cdiv(c, block_c))
    isz = x.element_size()
    _conv_update_kernel[grid](
        x, x.stride(0), typed_arena(arena, x.dtype), s_v2p, slot_ids, weight, weight if bias is None else bias, out,
        s_v2p.numel(), slot_bytes // isz, conv_offset // isz, c, K=kernel, BC=block_c, BK=triton.next_power_of_2(kernel),
        HAS_BIAS=bias is not None, SILU=activation is not None,
    )
    return out


# ---------------------------------------------------------------------------- declaration
@torch.library.custom_op("unimem::causal_conv1d_update", mutates_args=("arena",))
def causal_conv1d_update(x: torch.Tensor, arena: torch.Tensor, s_v2p: torch.Tensor, slot_ids: torch.Tensor,
                         conv_offset: int, slot_bytes: int, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """One causal depthwise-conv decode step per lane, the lane's conv state updated in place in its slot.

    Args:
        x: ``[B, C]`` fp32/fp16/bf16, this step's raw (pre-conv) channels; its dtype is the conv state's.
        arena: uint8 ``[memory_budget]`` (mutated: the conv sections of live lanes).
        s_v2p: int64 ``[num_slots]``. slot_ids: int64 ``[B]`` virtual slots (< 0 = none).
        conv_offset: byte offset of the conv section ``[C, K]`` (x's dtype, row-major) inside a slot.
        slot_bytes: the slot pitch in bytes.
        weight: ``[C, K]`` (``conv1d.weight.squeeze(1)``). bias: ``[C]`` or None.
        activation: None, ``"silu"`` or ``"swish"``.

    Returns:
        a fresh ``[B, C]`` in x's dtype (see the module docstring for the math). A masked lane's output is
        the convolution of a zero state with its x; its slot is not written.

    Raises:
        TypeError / GeometryError / ValueError: wrong dtypes or shapes (the message gives both), an unknown
        activation, a conv section that does not fit in the slot; under ``UNIMEM_DEBUG=1`` dead or
        repeated slot ids.
    """
    _check("causal_conv1d_update", x, arena, s_v2p, slot_ids, conv_offset, slot_bytes, weight, bias, activation)
    shape = [x.shape[1], weight.shape[1]]
    state = gather_sections(arena, s_v2p, slot_ids, conv_offset, slot_bytes, shape, x.dtype)
    out, new_state = causal_conv1d_step(x, state, weight, bias, activation)
    scatter_sections(arena, s_v2p, slot_ids, new_state, conv_offset, slot_bytes)
    return out.contiguous()


@causal_conv1d_update.register_kernel("cuda")
def _(x, arena, s_v2p, slot_ids, conv_offset, slot_bytes, weight, bias=None, activation=None):
    return causal_conv1d_update_triton(x, arena, s_v2p, slot_ids, conv_offset, slot_bytes, weight, bias, activation)


@causal_conv1d_update.register_fake
def _(x, arena, s_v2p, slot_ids, conv_offset, slot_bytes, weight, bias=None, activation=None):
    check_same_device("causal_conv1d_update", x=x, arena=arena, s_v2p=s_v2p, slot_ids=slot_ids, weight=weight, bias=bias)
    return x.new_empty(x.shape)


def _conv_state_bytes(a) -> int | None:
    x, weight = a["x"], a["weight"]  # the section is [C, K] of x's dtype
    return None if x is None or weight is None else x.shape[1] * weight.shape[1] * x.element_size()


declare_slot_footprint("unimem::causal_conv1d_update", offset="conv_offset", nbytes=_conv_state_bytes)
