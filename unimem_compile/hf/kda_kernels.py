"""unimem-backed replacements for the KDA kernel functions of transformers' Kimi-Linear model.

transformers runs ``chunk_kimi_delta_attention`` (prefill) as a pure-torch double loop when
flash-linear-attention is absent: traced by Dynamo it unrolls into ~1850 nodes per 4 layers and
recompiles for every number of 64-token chunks. The replacement below has the same signature and
semantics but calls one opaque op, ``unimem::kda_chunk``, whose CUDA implementation uses
flash-linear-attention's chunked kernels where installed.
"""

from __future__ import annotations

import torch

__all__ = ["chunk_kimi_delta_attention"]


def chunk_kimi_delta_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drop-in for transformers' function: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g ``[B, T, H, K]``
    (log decay), beta ``[B, T, H]``, initial_state ``[B, H, K, V]`` fp32 or None (zeros).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state [B, H, K, V] fp32 or None)``.
    """
    del chunk_size, kwargs  # the op picks its own chunking; extra HF kwargs carry no meaning here
    B, _, H, K = key.shape
    V = value.shape[-1]
    if initial_state is None:
        initial_state = key.new_zeros(B, H, K, V, dtype=torch.float32)
    # Contiguous here, in the graph: q, k, v are strided views of the conv output [B, C, T], and a custom
    # op keeps its inputs' traced strides under Inductor, which then gives each of the three a buffer
    # the size of the whole conv output (3x the bytes; +6 GiB at batch 32 x 4096 tokens on the 48B
    # geometry, benchmarks/results/memdiag_2026-11-29.log). Asked for here, the copy fuses with the SiLU
    # that produces them and each gets a dense buffer of its own size.
    out, final = torch.ops.unimem.kda_chunk(
        query.contiguous(), key.contiguous(), value.contiguous(), g.contiguous(), beta.contiguous(),
        initial_state.to(torch.float32), K**-0.5, use_qk_l2norm_in_kernel,
    )
    return out, (final if output_final_state else None)
