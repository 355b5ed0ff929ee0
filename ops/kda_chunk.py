"""Op ``unimem::kda_chunk``: chunked KDA over a whole prompt, functional (state in, state out).

The state-slot ops of :mod:`unimem_compile.ops.kda` address states in the arena; this functional form is
what the Kimi-Linear adapter hands transformers in place of ``chunk_kimi_delta_attention`` (whose pure
torch loops unroll under Dynamo and recompile for every number of chunks): transformers gathers the
state through the cache, calls this, and stores the final state through the cache. One opaque node per
layer, whatever the prompt length.
"""

from __future__ import annotations

import torch

from .common import FLOAT_INPUT_DTYPES, check_same_device, check_tensor
from .common import HOST_PLANNED
from .kda import chunk_kda_cuda, kda_chunked

__all__ = ["kda_chunk"]


def _check(q, k, v, g, beta, initial_state):
    op = "kda_chunk"
    check_tensor(op, "q", q, dtype=FLOAT_INPUT_DTYPES, dim=4)
    b, t, h, dk = q.shape
    check_tensor(op, "k", k, dtype=FLOAT_INPUT_DTYPES, shape=(b, t, h, dk))
    check_tensor(op, "v", v, dtype=FLOAT_INPUT_DTYPES, dim=4, shape=(b, t, h, None))
    check_tensor(op, "g", g, dtype=tuple(dict.fromkeys((torch.float32, q.dtype))), shape=(b, t, h, dk))
    check_tensor(op, "beta", beta, dtype=FLOAT_INPUT_DTYPES, shape=(b, t, h))
    check_tensor(op, "initial_state", initial_state, dtype=torch.float32, shape=(b, h, dk, v.shape[-1]))
    check_same_device(op, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)


@torch.library.custom_op("unimem::kda_chunk", mutates_args=(), tags=HOST_PLANNED)
def kda_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, scale: float, use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over T tokens from ``initial_state``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log-decay (fp32 or q's dtype);
        beta: ``[B, T, H]``; initial_state: fp32 ``[B, H, K, V]`` (not modified); scale: the query scale
        (transformers uses ``K ** -0.5``); use_qk_l2norm: L2-normalise q and k first (eps 1e-6).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state fp32 [B, H, K, V])``, fresh tensors.

    Math: :func:`unimem_compile.ops.kda.kda_chunked` (pure torch); on CUDA
    :func:`unimem_compile.ops.kda.chunk_kda_cuda` (flash-linear-attention's ``chunk_kda`` where the optional
    ``fla`` package imports, replayed from a captured graph per chunk-length bucket, :mod:`.kda_graphs`).
    """
    _check(q, k, v, g, beta, initial_state)
    o, final = kda_chunked(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
    return o.contiguous(), final.contiguous()


@kda_chunk.register_kernel("cuda")
def _(q, k, v, g, beta, initial_state, scale, use_qk_l2norm):
    _check(q, k, v, g, beta, initial_state)
    return chunk_kda_cuda(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, op="kda_chunk")


@kda_chunk.register_fake
def _(q, k, v, g, beta, initial_state, scale, use_qk_l2norm):
    check_same_device("kda_chunk", q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    b, t, h, _ = q.shape
    return q.new_empty(b, t, h, v.shape[-1]), initial_state.new_empty(initial_state.shape)
