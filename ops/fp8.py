"""The fp8 MLA row codec: e4m3 encode / decode in Triton (integer ops) and the plain-torch references.

An fp8 row (:class:`~unimem_compile.pool.specs.MLARowFormat`, docs/design.md section 3.3) holds R fp8 latent
codes, ``ceil(R / 128)`` fp32 scales and Dr bf16 rope values. The write side quantises each 128-value tile
of a row from the values written, nothing calibrated ahead::

    scale = max |x| / finfo(fmt).max            (fp32; 448 for e4m3fn, 240 for e4m3fnuz; 0 for a tile of zeros)
    code  = fp8(x / scale)                      (round to nearest even, IEEE division; code 0 where scale is 0)

and the read side dequantises ``value = bf16(fp32(code) * scale)``. Error bound per element (e4m3 keeps 3
mantissa bits, so rounding to it moves a normal value by at most half a step, 2^-4 of the value; a
subnormal code by at most half the subnormal step, ``scale * 2^-10`` or less, at most ``2^-10 / 240`` of
the tile's maximum; the fp32 division and product add 2^-24 relative)::

    |x - scale * code| <= 2^-4 * |x| + 2^-10 * scale   <= 2^-4 * max |tile| * (1 + 2^-13)
    |x - value|        <= that + 2^-8 * |scale * code| (the bf16 rounding of the read, 7 mantissa bits)

so a value read back lies within ``(2^-4 + 2^-8 * (1 + 2^-4)) * max |tile|`` (under 0.0667 of the tile's
largest magnitude) and within ``2^-4 + 2^-7`` of itself for values above ``2^-6`` of the tile's maximum.

The Triton helpers encode and decode the bits with integer arithmetic, for both formats, so one code path
runs in the interpreter, on sm_90 (where Triton has no e4m3fnuz type) and elsewhere, bit for bit the same as
torch's own conversions (``x.to(fmt)`` / ``codes.view(fmt).to(torch.float32)``; tests/ops/test_fp8.py).
Non-finite inputs: a tile holding a NaN or an infinity gets a non-finite scale, so the whole tile reads back
as NaN / inf (its codes are unspecified).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_compile.pool.specs import FP8_KV_DTYPES, FP8_ROW_DTYPE, FP8_TILE, MLARowFormat

__all__ = ["FNUZ", "F16_BITS_EXPONENT", "fp8_encode", "fp8_decode", "fp8_f16_bits", "fp8_nanmax", "to_bf16_rne",
           "quantize_rows", "dequantize_rows", "codes_as_f16", "dequantize_f16", "tile_scales"]

#: fp8 KV dtype -> whether it is the FNUZ variant (the ``FNUZ`` constexpr of the Triton helpers).
FNUZ = {dtype: "fnuz" in str(dtype) for dtype in FP8_KV_DTYPES}


@triton.jit
def fp8_nanmax(a, b):
    """``tl.reduce`` combine function: the larger value, NaN if either is (a tile with a NaN gets a NaN scale)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def fp8_encode(x, FNUZ: tl.constexpr):
    """fp32 ``x`` -> e4m3 codes (int32 in [0, 255]), round to nearest even, |x| saturated to the format's max.

    ``FNUZ`` False: OCP e4m3fn (bias 7, max 448, -0 is 0x80); True: e4m3fnuz (bias 8, max 240, no negative
    zero: a value that rounds to zero is code 0). Normal results: the fp32 bits re-biased and rounded at
    bit 20 (the carry may move to the exponent); subnormal results (|x| below the smallest normal, 2^-6 or
    2^-7): the float sum ``|x| + 2^(23 - 2 - bias)`` rounds |x| to a multiple of the subnormal step 2^(-2-bias)
    in the IEEE add, and the sum's low bits are the code.
    """
    if FNUZ:
        max_value: tl.constexpr = 240.0
        magic: tl.constexpr = 8192.0  # 2^13: its fp32 ulp is the subnormal step 2^-10
        magic_bits: tl.constexpr = 140 << 23
        min_normal_bits: tl.constexpr = 120 << 23  # 2^-7
        rebias: tl.constexpr = (8 - 127) << 23
    else:
        max_value: tl.constexpr = 448.0
        magic: tl.constexpr = 16384.0  # 2^14: its fp32 ulp is the subnormal step 2^-9
        magic_bits: tl.constexpr = 141 << 23
        min_normal_bits: tl.constexpr = 121 << 23  # 2^-6
        rebias: tl.constexpr = (7 - 127) << 23
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.abs(x), max_value)
    bits = a.to(tl.int32, bitcast=True)
    subnormal = (a + magic).to(tl.int32, bitcast=True) - magic_bits
    normal = (bits + rebias + 0x7FFFF + ((bits >> 20) & 1)) >> 20
    code = tl.where(bits < min_normal_bits, subnormal, normal)
    if FNUZ:
        sign = tl.where(code == 0, 0, sign)
    return code | sign


@triton.jit
def fp8_decode(code, FNUZ: tl.constexpr):
    """e4m3 codes (integers in [0, 255]) -> fp32, exactly (every e4m3 value is an fp32 value).

    e4m3fn: 0x7F / 0xFF are NaN, 0x80 is -0; e4m3fnuz: 0x80 is the only NaN, exponent bias 8."""
    if FNUZ:
        to_fp32_bias: tl.constexpr = 127 - 8
        step: tl.constexpr = 0.0009765625  # 2^-10, the subnormal step
    else:
        to_fp32_bias: tl.constexpr = 127 - 7
        step: tl.constexpr = 0.001953125  # 2^-9
    code = code.to(tl.int32)
    e = (code >> 3) & 15
    m = code & 7
    normal = (((e + to_fp32_bias) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e > 0, normal, m.to(tl.float32) * step)
    value = tl.where(code >= 128, -mag, mag)
    if FNUZ:
        nan = code == 128
    else:
        nan = (code & 127) == 127
    return tl.where(nan, float("nan"), value)


#: fp8 KV dtype -> k such that :func:`fp8_f16_bits` of a code is its value times ``2^-k`` (the difference of the
#: exponent biases: f16's 15 less e4m3fn's 7, or less e4m3fnuz's 8): the kernel folds ``2^k`` into the tile's
#: scale.
F16_BITS_EXPONENT = {torch.float8_e4m3fn: 8, torch.float8_e4m3fnuz: 7}


@triton.jit
def fp8_f16_bits(code):
    """e4m3 codes (uint8 or any integer type holding [0, 255]) -> f16, with integer ops only: ``((b & 0x80) << 8)
    | ((b & 0x7F) << 7)``, computed as ``(b + (b & 0x80)) << 7`` (an AND, an ADD, a shift), the sign moved to
    f16's sign bit, the 4 exponent and 3 mantissa bits to the top of f16's 5 exponent and 10 mantissa bits. That f16 is exactly the code's value times ``2^-k`` (:data:`F16_BITS_EXPONENT`: 8 for
    e4m3fn, 7 for e4m3fnuz: only the exponent bias differs), subnormal codes included (e4m3's subnormals land
    on f16's), so one integer path serves both formats with no conversion instruction. The NaN codes are not
    NaN here (e4m3fn's 0x7F / 0xFF read as +-1.875, e4m3fnuz's 0x80 as -0): the write never stores them for a
    finite tile (it saturates to the format's max), and a non-finite tile's scale is non-finite anyway."""
    c = code.to(tl.int16)
    return ((c + (c & 0x80)) << 7).to(tl.float16, bitcast=True)


@triton.jit
def to_bf16_rne(x):
    """fp32 -> bf16, round to nearest even, with integer ops (what ``cvt.rn.bf16.f32`` does on the GPU: the
    Triton interpreter's own float conversion truncates, so a ``.to(tl.bfloat16)`` could not be checked
    there). NaN stays NaN; values past bf16's max round to +-inf, as torch's conversion does."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = tl.where(x != x, bits | 0x400000, rounded)  # a NaN's payload must not carry into the exponent
    return (rounded >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


# ------------------------------------------------------------------------------------------ references
def tile_scales(x: torch.Tensor, fmt: MLARowFormat) -> torch.Tensor:
    """fp32 ``[T, ceil(R / 128)]`` scales of latents ``x [T, R]``: ``max |tile| / finfo(fmt.dtype).max``
    (NaN-propagating, as the kernel's)."""
    t, r = x.shape
    tiles = torch.nn.functional.pad(x.to(torch.float32), (0, fmt.num_scales * FP8_TILE - r))
    # divided by a tensor on x's device: torch's CUDA division by a Python (CPU) scalar multiplies by its
    # reciprocal (aten's div_true_kernel_cuda: "may lose one bit"), 1/448 and 1/240 are inexact, and the
    # kernels' scale is the IEEE quotient (tl.math.div_rn), as the CPU's division is
    amax = tiles.view(t, fmt.num_scales, FP8_TILE).abs().amax(-1)
    return amax / torch.tensor(fmt.fp8_max, dtype=torch.float32, device=x.device)


def quantize_rows(kv_nope: torch.Tensor, k_rope: torch.Tensor, fmt: MLARowFormat) -> torch.Tensor:
    """Plain-torch fp8 rows of ``[kv_nope | k_rope]`` (``[T, R]``, ``[T, Dr]``, any float dtypes).

    Returns:
        uint8 ``[T, fmt.row_bytes]``: codes ``(x / scale).clamp(+-max).to(fmt.dtype)`` (0 where scale is
        0), the fp32 scales of :func:`tile_scales`, ``k_rope`` rounded to bf16, zero padding.
    """
    t, r = kv_nope.shape
    scale = tile_scales(kv_nope, fmt)
    per_value = scale.repeat_interleave(FP8_TILE, dim=1)[:, :r]
    x = kv_nope.to(torch.float32)
    scaled = per_value > 0
    q = torch.where(scaled, x / torch.where(scaled, per_value, 1.0), 0.0).clamp(-fmt.fp8_max, fmt.fp8_max)
    out = torch.zeros(t, fmt.row_bytes, dtype=torch.uint8, device=kv_nope.device)
    out[:, :r] = q.to(fmt.dtype).view(torch.uint8)
    # flattened first: a [T, 1] or [0, S] result may carry a stride-0 dimension, which a dtype view refuses
    out[:, fmt.scale_offset: fmt.rope_offset] = scale.contiguous().view(-1).view(torch.uint8).view(t, 4 * fmt.num_scales)
    rope = k_rope.to(FP8_ROW_DTYPE).contiguous().view(torch.uint8)
    out[:, fmt.rope_offset: fmt.rope_offset + rope.shape[1]] = rope
    return out


def dequantize_rows(rows: torch.Tensor, fmt: MLARowFormat) -> torch.Tensor:
    """Plain-torch values of fp8 rows: uint8 ``[..., fmt.row_bytes]`` -> bf16 ``[..., R + Dr]``, latent
    value ``i`` = ``bf16(fp32(code_i) * scale[i // 128])``, then the rope values as stored."""
    r, dr = fmt.kv_lora_rank, fmt.qk_rope_head_dim
    rows = rows.contiguous()
    codes = rows[..., :r].view(fmt.dtype).to(torch.float32)
    scale = rows[..., fmt.scale_offset: fmt.rope_offset].view(torch.float32)
    latent = (codes * scale.repeat_interleave(FP8_TILE, dim=-1)[..., :r]).to(FP8_ROW_DTYPE)
    rope = rows[..., fmt.rope_offset: fmt.rope_offset + 2 * dr].view(FP8_ROW_DTYPE)
    return torch.cat([latent, rope], dim=-1)


def codes_as_f16(codes: torch.Tensor) -> torch.Tensor:
    """Plain-torch :func:`fp8_f16_bits`: uint8 codes ``[...]`` -> f16 ``[...]``, each the code's value times
    ``2^-F16_BITS_EXPONENT[fmt]`` (the NaN codes excepted, as there)."""
    c = codes.to(torch.int16)
    return (((c & 0x80) << 8) | ((c & 0x7F) << 7)).view(torch.float16)


def dequantize_f16(rows: torch.Tensor, fmt: MLARowFormat) -> torch.Tensor:
    """Plain-torch values of fp8 rows as the Hopper fp8 kernel's f16 chain computes them (``f16_values``):
    uint8 ``[..., fmt.row_bytes]`` -> f16 ``[..., R]``, latent value ``i`` = ``f16(codes_as_f16(code_i) *
    f16(scale[i // 128] * 2^k))`` (both factors f16, one f16 product, rounded to nearest even).

    Against the exact ``code x scale``: the scale's rounding to f16 (2^-11 relative while ``scale * 2^k`` is a
    normal f16, at least 2^-14: tiles whose largest magnitude is above 448 x 2^-22 = 1.07e-4 for e4m3fn,
    240 x 2^-21 = 1.14e-4 for e4m3fnuz; below, the scale keeps fewer bits) and the product's (2^-11), so within ``2^-10 (1 + 2^-11)`` of the value, against bf16's 2^-8 for
    :func:`dequantize_rows`; a dequantised latent above f16's 65504 overflows to inf (a tile whose largest
    magnitude is above 65504; bf16 would hold it)."""
    r = fmt.kv_lora_rank
    rows = rows.contiguous()
    scale = rows[..., fmt.scale_offset: fmt.rope_offset].view(torch.float32)
    scale16 = (scale * 2.0 ** F16_BITS_EXPONENT[fmt.dtype]).to(torch.float16)
    return codes_as_f16(rows[..., :r]) * scale16.repeat_interleave(FP8_TILE, dim=-1)[..., :r]
