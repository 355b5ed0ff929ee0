"""unimem-backed replacements for the KDA kernel functions of transformers' Kimi-Linear model.

transformers runs ``chunk_kimi_delta_attention`` (prefill) as a pure-torch double loop when
flash-linear-attention is absent: traced by Dynamo it unrolls into ~1850 nodes per 4 layers and
recompiles for every number of 64-token chunks. The replacement below has the same signature and
semantics but calls one opaque op, ``unimem::kda_chunk``, whose CUDA implementation uses
flash-linear-attention's chunked kernels where installed.

:func:`causal_conv1d_shifted` is the prefill short convolution as K shifted multiply-adds, which Inductor
fuses into one pointwise kernel (with the activation), instead of transformers' ``F.conv1d(groups=C)``,
which runs aten's generic depthwise kernel (``conv_depthwise2d_forward``: 12.6 ms of a 32k-token prefill's
93.7 ms of kernels on an H200, 0.5 ms per call at 4,096 tokens x 12,288 channels,
benchmarks/results/prefill_model_2026-12-04_s21_call1.json). Opt-in (``UNIMEM_PREFILL_CONV=shifted``) until
a GPU run has timed and checked it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunk_kimi_delta_attention", "causal_conv1d_shifted"]


def causal_conv1d_shifted(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          activation: str | None = None, **kwargs) -> torch.Tensor:
    """Drop-in for transformers' Kimi-Linear ``causal_conv1d_fn`` (its torch path): the causal depthwise
    convolution ``out[b, c, t] = act(bias[c] + sum_k weight[c, k] * x[b, c, t + k - (K - 1)])`` with
    ``x[..., j] = 0`` for ``j < 0``, i.e. ``F.conv1d(x, weight[:, None], bias, padding=K - 1, groups=C)[..., :L]``.

    Args:
        hidden_states: ``[B, C, L]`` (any strides; the caller's left context, the conv state, is already
            prepended by the cache). weight: ``[C, K]``. bias: ``[C]`` or None. activation: None, ``"silu"``
            or ``"swish"`` (transformers' ACT2FN names).

    Returns:
        a fresh ``[B, C, L]`` in ``hidden_states``' dtype. As the original, ``x`` is first rounded to the
        weight's dtype; the products, the sum over k (in order), the bias and the activation then run in fp32
        for a 16-bit weight (else in the weight's dtype) and the result is rounded to the weight's dtype once,
        then to ``hidden_states``' dtype (a convolution kernel accumulates in fp32 too; it rounds before the
        activation, this after it). Not bit-equal to ``F.conv1d``: the summation order differs
        (tests/hf/test_prefill_conv.py bounds it)."""
    del kwargs
    from transformers.activations import ACT2FN

    length, k_size = hidden_states.shape[-1], weight.shape[-1]
    acc = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
    x = F.pad(hidden_states.to(weight.dtype).to(acc), (k_size - 1, 0))
    w = weight.to(acc)
    out = x[..., 0:length] * w[:, 0:1]
    for k in range(1, k_size):
        out = out + x[..., k:k + length] * w[:, k:k + 1]
    if bias is not None:
        out = out + bias.to(acc)[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(weight.dtype).to(hidden_states.dtype)


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
