"""Ops ``unimem::kda_decode`` and ``unimem::kda_prefill``: Kimi Delta Attention over states in arena slots.

KDA (Kimi Linear, arXiv 2510.26692) is the gated delta rule with a per-channel decay. Per head, with the
fp32 state ``S [K, V]``, one token ``(q, k [K], v [V], g [K] log-decay, beta scalar)`` does

    q, k = l2norm(q), l2norm(k)          if use_qk_l2norm;  l2norm(x) = x / sqrt(sum(x^2) + 1e-6)
    q = q * scale
    S = S * exp(g)[:, None]              (decay each K row)
    delta = (v - k^T S) * beta
    S = S + k delta^T
    o = q^T S

in fp32, exactly as transformers' ``recurrent_kimi_delta_attention`` and flash-linear-attention's
``fused_recurrent_kda`` compute it. The state of lane b is the ``[H, K, V]`` fp32 section at byte
``state_offset`` of its slot (addressed as in :mod:`unimem_compile.ops.state`); it is read once and the
updated state is left in the slot. Masked lanes (slot id < 0, tombstone, the sink) start from a zero state
and write nothing.

``kda_decode`` is one token per lane (our Triton kernel on CUDA). ``kda_prefill`` runs T tokens per lane:
the chunked form below in pure torch, or flash-linear-attention's ``chunk_kda`` on CUDA when the ``fla``
package imports (:func:`chunk_kda_cuda`, replayed from a CUDA graph per chunk-length bucket where
:mod:`unimem_compile.ops.kda_graphs` allows it).
"""

from __future__ import annotations

import functools
import importlib
import warnings

import torch
import triton
import triton.language as tl

from .common import (FLOAT_INPUT_DTYPES, check_knob, check_same_device, check_slot_geometry, check_slot_ids,
                     check_tensor, declare_slot_footprint, typed_arena)
from .common import HOST_PLANNED
from .state import gather_sections, scatter_sections, state_gather_triton, state_scatter_triton

__all__ = [
    "kda_decode",
    "kda_prefill",
    "kda_decode_triton",
    "kda_prefill_cuda",
    "chunk_kda_cuda",
    "kda_recurrent",
    "kda_chunked",
    "fla_chunk_kda",
    "kda_prefill_backend",
    "l2norm_reference",
    "kda_state_step",
    "kda_step_output",
]

L2NORM_EPS = 1e-6


# ---------------------------------------------------------------------------- pure-torch references
# The three step functions below are also the search functions of the ``kda_state_inplace`` rewrite
# (passes/kda_state_inplace.py traces them): a change here changes what the rewrite matches.
def l2norm_reference(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x * x, -1) + 1e-6)`` over the last axis (any shape, x's dtype; transformers' and
    flash-linear-attention's ``l2norm``: the epsilon is added, not a lower bound as in ``F.normalize``)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def kda_state_step(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule on the state (the module docstring's decay, delta and update).

    Args:
        state: ``[B, H, K, V]``. k, g: ``[B, H, K]`` (g the log-decay). v: ``[B, H, V]``. beta: ``[B, H]``.

    Returns:
        the new state, ``[B, H, K, V]`` (a fresh tensor; the inputs are not modified).
    """
    state = state * g.exp().unsqueeze(-1)
    delta = (v - (state * k.unsqueeze(-1)).sum(-2)) * beta.unsqueeze(-1)
    return state + k.unsqueeze(-1) * delta.unsqueeze(-2)


def kda_step_output(state: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``o = q^T S`` per head: ``state [B, H, K, V]`` (the new state), ``q [B, H, K]`` -> ``[B, H, V]``."""
    return (state * q.unsqueeze(-1)).sum(-2)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm_reference(q), l2norm_reference(k)
    return q * scale, k, v, g, beta


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, scale: float, use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA recurrence token by token (the definition; pure torch, fp32 math).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log-decay; beta: ``[B, T, H]``.
        state: ``[B, H, K, V]`` initial state (not modified).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32)``.
    """
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    s = state.float().clone()
    out = []
    for t in range(q.shape[1]):
        s = kda_state_step(s, kf[:, t], vf[:, t], gf[:, t], bf[:, t])
        out.append(kda_step_output(s, qf[:, t]))
    o = torch.stack(out, 1) if out else vf.new_empty(vf.shape)
    return o.to(q.dtype), s


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, scale: float, use_qk_l2norm: bool,
                chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result as :func:`kda_recurrent`, computed chunk by chunk (pure torch, fp32).

    Within a chunk, with ``G_t`` the inclusive cumulative log-decay and ``S0`` the state entering it, the
    recurrence unrolls to the WY / UT-transform form of the gated delta rule (Yang et al., "Gated Delta
    Networks", and the KDA paper): the chunk's deltas solve the unit lower-triangular system

        (I + A) Delta = diag(beta) (V - (K * exp(G)) S0),  A[t, s] = beta_t sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c]), s < t

    and then ``O = (Q * exp(G)) S0 + (Q K^T)_{decayed, s <= t} Delta`` and
    ``S = exp(G_last) * S0 + (K * exp(G_last - G))^T Delta``. Decays enter only as ``exp(G_t - G_s)`` with
    ``s <= t`` (never above 1), so no factor overflows whatever the gate. Memory per chunk:
    ``B * H * chunk_size^2 * K`` fp32 values.

    Args and result as :func:`kda_recurrent`.
    """
    b, t_len, h, dk = q.shape
    qf, kf, vf, gf, bf = (x.transpose(1, 2) for x in _prepare(q, k, v, g, beta, scale, use_qk_l2norm))
    s = state.float().clone()
    out = vf.new_empty(vf.shape)
    for start in range(0, t_len, chunk_size):
        end = min(start + chunk_size, t_len)
        n = end - start
        qc, kc, vc, bc = qf[:, :, start:end], kf[:, :, start:end], vf[:, :, start:end], bf[:, :, start:end]
        cum = gf[:, :, start:end].cumsum(-2)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum.unsqueeze(-2) - cum.unsqueeze(-3)).masked_fill(~causal[..., None], float("-inf")).exp()
        kk = torch.einsum("bhtc,bhsc,bhtsc->bhts", kc, kc, decay)
        a = (kk * bc.unsqueeze(-1)).tril(-1)
        rhs = bc.unsqueeze(-1) * (vc - (kc * cum.exp()) @ s)
        delta = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        qk = torch.einsum("bhtc,bhsc,bhtsc->bhts", qc, kc, decay)
        out[:, :, start:end] = (qc * cum.exp()) @ s + qk @ delta
        last = cum[:, :, -1:]
        s = last.transpose(-1, -2).exp() * s + (kc * (last - cum).exp()).transpose(-1, -2) @ delta
    return out.transpose(1, 2).to(q.dtype), s


# ---------------------------------------------------------------------------- checks
def _check_common(op, q, k, v, g, beta, arena, s_v2p, slot_ids, state_offset, slot_bytes, lead: int):
    """Shapes ``q, k, g [*lead, H, K]``, ``v [*lead, H, V]``, ``beta [*lead, H]``; returns (B, H, K, V)."""
    check_tensor(op, "q", q, dtype=FLOAT_INPUT_DTYPES, dim=lead + 2)
    *lead_shape, h, dk = q.shape
    check_tensor(op, "k", k, dtype=FLOAT_INPUT_DTYPES, shape=tuple(q.shape))
    check_tensor(op, "v", v, dtype=FLOAT_INPUT_DTYPES, shape=(*lead_shape, h, None))
    check_tensor(op, "g", g, dtype=torch.float32, shape=tuple(q.shape))
    check_tensor(op, "beta", beta, dtype=FLOAT_INPUT_DTYPES, shape=(*lead_shape, h))
    dv = v.shape[-1]
    check_slot_geometry(op, arena, s_v2p, state_offset, h * dk * dv * 4, slot_bytes)
    check_same_device(op, q=q, k=k, v=v, g=g, beta=beta, arena=arena, s_v2p=s_v2p, slot_ids=slot_ids)
    check_slot_ids(op, s_v2p, slot_ids, q.shape[0])
    return q.shape[0], h, dk, dv


# ---------------------------------------------------------------------------- Triton decode kernel
@triton.jit
def _kda_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, arena_ptr, s_v2p_ptr, slot_ptr,
                       sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sg_h, sb_b, sb_h,
                       num_slots, slot_elems, offset_elems, scale,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       L2NORM: tl.constexpr):
    # program (lane, head, V block) owns the [K, BV] fp32 tile of one head's state: each V column evolves
    # independently given the K-vectors q, k, g, so the tile is read once, kept in registers, written once
    lane = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    in_k = rk < K
    in_v = rv < V
    sid = tl.load(slot_ptr + lane)
    ok = (sid >= 0) & (sid < num_slots)
    phys = tl.load(s_v2p_ptr + tl.where(ok, sid, 0), mask=ok, other=-1)  # masked before indexing the table
    ok = ok & (phys > 0)
    # a masked lane sees zero rows of state (a scalar `ok` in a vector mask is mis-typed by the interpreter)
    live_k = rk < tl.where(ok, K, 0)
    # arena_ptr is the arena typed as fp32: offsets in elements, 16-byte aligned (the slot geometry checks)
    base = tl.multiple_of(tl.where(ok, phys, 0) * slot_elems + offset_elems, 4)
    tile = arena_ptr + base + h * (K * V) + rk[:, None] * V + rv[None, :]
    tile_mask = live_k[:, None] & in_v[None, :]
    # the state load goes first so its latency overlaps the small loads and the l2norm reductions (source
    # order is issue order across their barriers)
    s = tl.load(tile, mask=tile_mask, other=0, eviction_policy="evict_first")

    q = tl.load(q_ptr + lane * sq_b + h * sq_h + rk, mask=in_k, other=0).to(tl.float32)
    k = tl.load(k_ptr + lane * sk_b + h * sk_h + rk, mask=in_k, other=0).to(tl.float32)
    g = tl.load(g_ptr + lane * sg_b + h * sg_h + rk, mask=in_k, other=0).to(tl.float32)
    v = tl.load(v_ptr + lane * sv_b + h * sv_h + rv, mask=in_v, other=0).to(tl.float32)
    beta = tl.load(beta_ptr + lane * sb_b + h * sb_h).to(tl.float32)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    q = q * scale

    s = s * tl.exp(g)[:, None]
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + (lane * H + h) * V + rv, o.to(out_ptr.dtype.element_ty), mask=in_v)
    tl.store(tile, s, mask=tile_mask, eviction_policy="evict_first")


def _row_strides(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(tensor with unit last stride, batch stride, head stride) of a ``[B, H, X]`` / ``[B, H]`` input."""
    if t.dim() == 3 and t.stride(2) != 1:
        t = t.contiguous()
    return t, t.stride(0), t.stride(1)


def kda_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      arena: torch.Tensor, s_v2p: torch.Tensor, slot_ids: torch.Tensor, state_offset: int,
                      slot_bytes: int, scale: float, use_qk_l2norm: bool, *, block_v: int = 64,
                      num_warps: int = 4) -> torch.Tensor:
    """Triton launcher of :func:`kda_decode`: grid ``(B, H, V / block_v)``.

    q, k, v, g and beta may be strided views (e.g. heads split out of one projection) as long as their last
    dimension has stride 1 (otherwise they are copied). ``block_v`` and ``num_warps`` (powers of two >= 1,
    else ValueError) are tuning knobs. Defaults 64 and 4: the fastest of block_v 16-128 x 1-8 warps at 32
    heads, 128 x 128
    (``benchmarks/bench_kda.py --sweep`` on an H200: 0.86-0.88 of the copy bandwidth in a CUDA graph, against
    0.76 for flash-linear-attention's 32 / 4 and 0.78-0.81 for its own kernel; benchmarks/RESULTS.md).
    """
    _, h, dk, dv = _check_common("kda_decode", q, k, v, g, beta, arena, s_v2p, slot_ids, state_offset,
                                 slot_bytes, lead=1)
    check_knob("kda_decode", "block_v", block_v, power_of_two=True)
    check_knob("kda_decode", "num_warps", num_warps, power_of_two=True)
    b = q.shape[0]
    out = torch.empty((b, h, dv), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    (q, sqb, sqh), (k, skb, skh), (v, svb, svh), (g, sgb, sgh) = map(_row_strides, (q, k, v, g))
    beta, sbb, sbh = _row_strides(beta)
    bv = min(block_v, triton.next_power_of_2(dv))
    grid = (b, h, triton.cdiv(dv, bv))
    _kda_decode_kernel[grid](
        q, k, v, g, beta, out, typed_arena(arena, torch.float32), s_v2p, slot_ids.contiguous(),
        sqb, sqh, skb, skh, svb, svh, sgb, sgh, sbb, sbh, s_v2p.numel(), slot_bytes // 4, state_offset // 4, float(scale),
        H=h, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=bv, L2NORM=bool(use_qk_l2norm), num_warps=num_warps,
    )
    return out


# ---------------------------------------------------------------------------- prefill on CUDA
@functools.cache
def _import_fla_chunk_kda():
    """``(chunk_kda, None)`` if ``fla.ops.kda`` imports, else ``(None, "<exception type>: <message>")``."""
    try:
        return importlib.import_module("fla.ops.kda").chunk_kda, None
    except Exception as e:  # any import failure (missing package, incompatible triton) means: use the reference
        return None, f"{type(e).__name__}: {e}"


def fla_chunk_kda():
    """flash-linear-attention's ``chunk_kda`` if the optional ``fla`` package imports, else None.

    The import is tried once per process; :func:`kda_prefill_backend` says which path CUDA prefills take and,
    for the reference, why.
    """
    return _import_fla_chunk_kda()[0]


def kda_prefill_backend() -> dict:
    """Which chunked-KDA implementation a CUDA prefill (``kda_prefill``, ``kda_chunk``) runs in this process.

    Returns ``{"backend": "fla", "version": <fla.__version__>}`` or ``{"backend": "reference", "reason":
    <the import error>}``. The pure-torch reference is several times slower on a GPU (2026-12-02, H200,
    8-layer Kimi-Linear geometry: ~240 ms per ~1.6k-token prefill forward against ~30 ms with fla), so
    benchmarks record this beside their numbers. CPU tensors always take the reference (fla is CUDA-only).
    """
    chunk, reason = _import_fla_chunk_kda()
    if chunk is None:
        return {"backend": "reference", "reason": reason}
    return {"backend": "fla", "version": getattr(importlib.import_module("fla"), "__version__", "unknown")}


_warned_reference_on_cuda = False


def warn_reference_on_cuda(op: str) -> None:
    """Warn once per process that ``op`` runs the pure-torch chunked KDA on CUDA tensors (fla did not import).

    Silent, this cost three sessions of serving benchmarks 5x on their prefills (2026-12-02): the answer was
    right and only the speed said anything.
    """
    global _warned_reference_on_cuda
    if _warned_reference_on_cuda:
        return
    _warned_reference_on_cuda = True
    warnings.warn(f"{op}: CUDA prefill runs the pure-torch chunked KDA reference because flash-linear-attention "
                  f"is not importable ({kda_prefill_backend()['reason']}); it is correct but several times "
                  f"slower: pip install fla-core (the `fla` extra of unimem-compile)",
                  RuntimeWarning, stacklevel=3)


def chunk_kda_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, scale: float, use_qk_l2norm: bool, *, op: str,
                   use_fla: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA of ``T`` tokens from ``state`` on CUDA tensors (CPU ones under the interpreter): the math of
    :func:`kda_chunked` through flash-linear-attention's ``chunk_kda`` (``use_fla=None``: when it imports and
    the tensors are on CUDA), replayed from a captured graph per chunk-length bucket where
    :mod:`unimem_compile.ops.kda_graphs` allows it, else eagerly; or :func:`kda_chunked` itself.

    Args: q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``; state fp32 ``[B, H, K, V]`` (not
    modified); ``op`` names the caller in messages. Returns ``(o [B, T, H, V] in q's dtype, final fp32
    [B, H, K, V])``, fresh contiguous tensors.

    Raises: RuntimeError when ``use_fla=True`` and fla does not import."""
    chunk = fla_chunk_kda() if q.is_cuda else None
    if use_fla is None:
        use_fla = chunk is not None
    elif use_fla and chunk is None:
        raise RuntimeError(f"{op}: use_fla=True but flash-linear-attention's chunk_kda is not importable here")
    if use_fla and q.shape[1] > 0:
        from .kda_graphs import GRAPHS

        out = GRAPHS(chunk, q, k, v, g, beta, state, scale, use_qk_l2norm)
        if out is None:
            out = chunk(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                        scale=float(scale), initial_state=state.contiguous(), output_final_state=True,
                        use_qk_l2norm_in_kernel=bool(use_qk_l2norm))
        o, final = out
    else:
        if q.is_cuda and chunk is None and q.shape[1] > 0:
            warn_reference_on_cuda(op)
        o, final = kda_chunked(q, k, v, g, beta, state, scale, use_qk_l2norm)
    return o.to(q.dtype).contiguous(), final.float().contiguous()


def kda_prefill_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     arena: torch.Tensor, s_v2p: torch.Tensor, slot_ids: torch.Tensor, state_offset: int,
                     slot_bytes: int, scale: float, use_qk_l2norm: bool, *, use_fla: bool | None = None) -> torch.Tensor:
    """Launcher of :func:`kda_prefill` for CUDA (also runs CPU tensors under ``TRITON_INTERPRET=1``).

    Gathers the lanes' states with the Triton gather kernel, runs :func:`chunk_kda_cuda` (fla where it
    imports, ``use_fla`` as there), and scatters the final states back with the Triton scatter kernel (masked
    lanes write nothing).
    """
    op = "kda_prefill"
    _, h, dk, dv = _check_common(op, q, k, v, g, beta, arena, s_v2p, slot_ids, state_offset, slot_bytes, lead=2)
    state = state_gather_triton(arena, s_v2p, slot_ids, state_offset, slot_bytes, [h, dk, dv], torch.float32)
    o, final = chunk_kda_cuda(q, k, v, g, beta, state, scale, use_qk_l2norm, op=op, use_fla=use_fla)
    state_scatter_triton(arena, s_v2p, slot_ids, final, state_offset, slot_bytes)
    return o


# ---------------------------------------------------------------------------- declarations
@torch.library.custom_op("unimem::kda_decode", mutates_args=("arena",))
def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               arena: torch.Tensor, s_v2p: torch.Tensor, slot_ids: torch.Tensor, state_offset: int,
               slot_bytes: int, scale: float, use_qk_l2norm: bool) -> torch.Tensor:
    """One KDA decode step per lane; the lane's ``[H, K, V]`` fp32 state is updated in place in its slot.

    Args:
        q, k: ``[B, H, K]`` fp32/fp16/bf16. v: ``[B, H, V]``. g: ``[B, H, K]`` fp32 log-decay (<= 0).
        beta: ``[B, H]``. arena: uint8 ``[memory_budget]`` (mutated: live lanes' recurrent sections).
        s_v2p: int64 ``[num_slots]``. slot_ids: int64 ``[B]`` virtual slots (< 0 = none).
        state_offset: byte offset of the recurrent section ``[H, K, V]`` fp32 inside a slot.
        slot_bytes: the slot pitch in bytes. scale: the query scale (``K ** -0.5`` in Kimi-Linear).
        use_qk_l2norm: L2-normalise q and k first (Kimi-Linear: True).

    Returns:
        a fresh ``[B, H, V]`` in q's dtype (the math is in the module docstring).

    Raises:
        TypeError / GeometryError / ValueError: wrong dtypes or shapes (both given in the message), a
        recurrent section that does not fit in the slot; under ``UNIMEM_DEBUG=1`` dead or repeated slots.
    """
    _, h, dk, dv = _check_common("kda_decode", q, k, v, g, beta, arena, s_v2p, slot_ids, state_offset,
                                 slot_bytes, lead=1)
    state = gather_sections(arena, s_v2p, slot_ids, state_offset, slot_bytes, [h, dk, dv], torch.float32)
    o, final = kda_recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state, scale,
                             use_qk_l2norm)
    scatter_sections(arena, s_v2p, slot_ids, final, state_offset, slot_bytes)
    return o[:, 0].contiguous()


@kda_decode.register_kernel("cuda")
def _(q, k, v, g, beta, arena, s_v2p, slot_ids, state_offset, slot_bytes, scale, use_qk_l2norm):
    return kda_decode_triton(q, k, v, g, beta, arena, s_v2p, slot_ids, state_offset, slot_bytes, scale,
                             use_qk_l2norm)


@kda_decode.register_fake
def _(q, k, v, g, beta, arena, s_v2p, slot_ids, state_offset, slot_bytes, scale, use_qk_l2norm):
    check_same_device("kda_decode", q=q, k=k, v=v, g=g, beta=beta, arena=arena, s_v2p=s_v2p, slot_ids=slot_ids)
    return q.new_empty(v.shape)


@torch.library.custom_op("unimem::kda_prefill", mutates_args=("arena",), tags=HOST_PLANNED)
def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                arena: torch.Tensor, s_v2p: torch.Tensor, slot_ids: torch.Tensor, state_offset: int,
                slot_bytes: int, scale: float, use_qk_l2norm: bool) -> torch.Tensor:
    """T KDA steps per lane: the initial state is read from the lane's slot and the final one left there.

    Args as :func:`kda_decode` with a token axis: q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``,
    beta ``[B, T, H]``. Returns a fresh ``[B, T, H, V]`` in q's dtype. Every lane runs all T tokens (pad
    positions are the caller's business, as in transformers). CPU: :func:`kda_chunked`; CUDA:
    :func:`kda_prefill_cuda`. Raises as :func:`kda_decode`.
    """
    _, h, dk, dv = _check_common("kda_prefill", q, k, v, g, beta, arena, s_v2p, slot_ids, state_offset,
                                 slot_bytes, lead=2)
    state = gather_sections(arena, s_v2p, slot_ids, state_offset, slot_bytes, [h, dk, dv], torch.float32)
    o, final = kda_chunked(q, k, v, g, beta, state, scale, use_qk_l2norm)
    scatter_sections(arena, s_v2p, slot_ids, final, state_offset, slot_bytes)
    return o.contiguous()


@kda_prefill.register_kernel("cuda")
def _(q, k, v, g, beta, arena, s_v2p, slot_ids, state_offset, slot_bytes, scale, use_qk_l2norm):
    return kda_prefill_cuda(q, k, v, g, beta, arena, s_v2p, slot_ids, state_offset, slot_bytes, scale,
                            use_qk_l2norm)


@kda_prefill.register_fake
def _(q, k, v, g, beta, arena, s_v2p, slot_ids, state_offset, slot_bytes, scale, use_qk_l2norm):
    check_same_device("kda_prefill", q=q, k=k, v=v, g=g, beta=beta, arena=arena, s_v2p=s_v2p, slot_ids=slot_ids)
    return q.new_empty(v.shape)


def _recurrent_state_bytes(a) -> int | None:
    q, v = a["q"], a["v"]  # the section is [H, K, V] fp32: q [.., H, K], v [.., H, V]
    return None if q is None or v is None else q.shape[-2] * q.shape[-1] * v.shape[-1] * 4


declare_slot_footprint("unimem::kda_decode", offset="state_offset", nbytes=_recurrent_state_bytes)
declare_slot_footprint("unimem::kda_prefill", offset="state_offset", nbytes=_recurrent_state_bytes)
