"""Sub-pool specs: what one token of KV cache and one request's state look like, in bytes.

A spec is a frozen dataclass that validates itself on construction (``GeometryError`` naming the field)
and carries the byte math the arena layout is built from. Three kinds:

* :class:`MLASpec`: the latent KV of multi-head latent attention (DeepSeek-V2/V3, Kimi-Linear): per token
  and MLA layer one row of ``kv_lora_rank + qk_rope_head_dim`` values (the normalised ``kv_nope`` latent,
  then the shared rope key).
* :class:`MHASpec`: classic per-head K and V (byte math only in this version; no views).
* :class:`LinearStateSpec`: the fixed per-request state of linear-attention layers (KDA, Gated DeltaNet,
  Mamba2): per layer a short-convolution section and a recurrent section, each with shape and dtype.

fp8 KV dtypes (e4m3fn, e5m2 and the FNUZ variants) are stored as ``torch.uint8``: the pool only moves their
bytes, so a round trip is bit-exact whatever the format's NaN / negative-zero encoding. An fp8 MLA row is a
scaled row (:class:`MLARowFormat`): the fp8 latent, one fp32 scale per 128 latent values and the rope key
in bf16, padded to 16 bytes (656 bytes at Kimi-Linear's 512 + 64, against 1152 in bf16).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ..errors import GeometryError

__all__ = [
    "ALIGN",
    "COMPUTE_DTYPES",
    "FP8_DTYPES",
    "FP8_KV_DTYPES",
    "FP8_ROW_DTYPE",
    "FP8_TILE",
    "KERNEL_KV_DTYPES",
    "KV_STORE_DTYPES",
    "MLARowFormat",
    "round_up",
    "store_dtype_of",
    "dtype_itemsize",
    "MLASpec",
    "MHASpec",
    "StateSection",
    "LinearLayerStateSpec",
    "LinearStateSpec",
]

#: Every section of the arena (state sections, KV rows) starts on this many bytes.
ALIGN = 16

#: fp8 formats; the pool stores all of them as uint8.
FP8_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)

#: The float dtypes of this version's arithmetic: what the unimem ops compute in (their float inputs and
#: results: latents written, histories gathered, queries attended with; the linear-attention ops' inputs)
#: and what a state section may hold. Error messages list them in this order.
COMPUTE_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
#: The fp8 formats the MLA ops quantise rows into and dequantise them from (scaled rows,
#: :class:`MLARowFormat`): OCP e4m3 (``float8_e4m3fn``, NVIDIA's, max 448) and its FNUZ variant
#: (``float8_e4m3fnuz``, AMD MI300's: exponent bias 8, no negative zero, one NaN 0x80, max 240).
FP8_KV_DTYPES: tuple[torch.dtype, ...] = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, name))
#: The KV dtypes the MLA ops take as ``kv_dtype``, and so what a compiled model's cache may use: rows
#: computed in directly (:data:`COMPUTE_DTYPES`) and the scaled fp8 rows (:data:`FP8_KV_DTYPES`).
KERNEL_KV_DTYPES: tuple[torch.dtype, ...] = COMPUTE_DTYPES + FP8_KV_DTYPES
#: What the pool stores as KV rows: the compute dtypes and every fp8 format (e5m2 ones are moved, never
#: computed on).
KV_STORE_DTYPES: frozenset[torch.dtype] = frozenset(COMPUTE_DTYPES) | FP8_DTYPES
#: Latent values per fp32 scale of an fp8 row (FlashMLA's fp8 KV format uses the same 128-value tiles).
FP8_TILE = 128
#: The dtype of an fp8 row's rope key, and the compute dtype of fp8 rows (what ``mla_gather`` returns).
FP8_ROW_DTYPE = torch.bfloat16


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``x`` (both non-negative ints)."""
    return -(-x // multiple) * multiple


def dtype_itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def store_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """The dtype the arena stores ``dtype`` as: ``torch.uint8`` for every fp8 format, else ``dtype``."""
    return torch.uint8 if dtype in FP8_DTYPES else dtype


def _check_positive_int(owner: str, field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GeometryError(f"{owner}.{field} must be a positive int, got {value!r}")


def _check_dtype(owner: str, field: str, value: object, allowed: frozenset[torch.dtype]) -> None:
    if value not in allowed:
        names = ", ".join(sorted(str(d) for d in allowed))
        raise GeometryError(f"{owner}.{field} must be one of {names}; got {value!r}")


@dataclasses.dataclass(frozen=True)
class MLARowFormat:
    """The byte layout of one MLA latent row (one token in one layer), docs/design.md section 3.3.

    A row of a compute dtype (bf16, fp16, fp32) is ``R + Dr`` values of it: ``kv_nope`` at byte 0, ``k_rot``
    at byte ``R * itemsize``, ``row_bytes = (R + Dr) * itemsize``.

    A row of an fp8 dtype (any of :data:`FP8_DTYPES`; the ops compute with :data:`FP8_KV_DTYPES`) is scaled::

        [0, R)                                  the R latent values, one fp8 byte each
        [scale_offset, scale_offset + 4 * S)    S = ceil(R / 128) fp32 scales, scale k for values [128k, 128k + 128)
        [rope_offset, rope_offset + 2 * Dr)     the Dr rope values in bf16 (:data:`FP8_ROW_DTYPE`)
        [.., row_bytes)                         zero padding to a multiple of 16 bytes

    with ``scale_offset = round_up(R, 4)``, ``rope_offset = scale_offset + 4 * S`` and ``row_bytes =
    round_up(rope_offset + 2 * Dr, 16)``: 512 + 16 + 128 = 656 bytes at R = 512, Dr = 64 (FlashMLA's fp8 KV
    layout for DeepSeek). Latent value ``i`` reads as ``fp8_to_fp32(byte i) * scale[i // 128]``, rounded once to
    bf16; the writer picks ``scale = max |x| / finfo(fp8).max`` over the tile's values (0 for a tile of zeros,
    which reads back as zeros).

    Args:
        kv_lora_rank: R, latent values per row (positive).
        qk_rope_head_dim: Dr, rope values per row (positive).
        dtype: the KV dtype (a compute dtype or an fp8 format).
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        """Whether this is a scaled fp8 row."""
        return self.dtype in FP8_DTYPES

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the row's values are read in: the KV dtype, bf16 for an fp8 row."""
        return FP8_ROW_DTYPE if self.quantized else self.dtype

    @property
    def rope_dtype(self) -> torch.dtype:
        """The dtype the rope values are stored in: the KV dtype, bf16 for an fp8 row."""
        return self.compute_dtype

    @property
    def num_scales(self) -> int:
        """fp32 scales per row: ``ceil(R / 128)`` for an fp8 row, 0 otherwise."""
        return -(-self.kv_lora_rank // FP8_TILE) if self.quantized else 0

    @property
    def scale_offset(self) -> int:
        """Byte offset of the first scale (fp8 rows; for others where the rope starts: no scales)."""
        return round_up(self.kv_lora_rank, 4) if self.quantized else self.rope_offset

    @property
    def rope_offset(self) -> int:
        """Byte offset of the rope values."""
        if self.quantized:
            return self.scale_offset + 4 * self.num_scales
        return self.kv_lora_rank * dtype_itemsize(self.dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes per row (fp8 rows: padded to a multiple of 16)."""
        if self.quantized:
            return round_up(self.rope_offset + 2 * self.qk_rope_head_dim, ALIGN)
        return (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_itemsize(self.dtype)

    @property
    def fp8_max(self) -> float:
        """The fp8 format's largest finite value, ``torch.finfo(dtype).max`` (448 for e4m3fn, 240 for
        e4m3fnuz): the value a tile's largest magnitude is scaled to. fp8 rows only."""
        return float(torch.finfo(self.dtype).max)


class _KVByteMath:
    """Byte math shared by the KV specs; subclasses define ``dtype``, ``layer_num`` and ``kv_cache_dim``."""

    @property
    def store_dtype(self) -> torch.dtype:
        """dtype of the arena's rows (uint8 for fp8 formats)."""
        return store_dtype_of(self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per stored element."""
        return dtype_itemsize(self.store_dtype)

    @property
    def entry_bytes(self) -> int:
        """Bytes of one row (one token in one layer): ``kv_cache_dim * itemsize`` (an fp8 MLA row: its
        :class:`MLARowFormat`'s ``row_bytes``)."""
        return self.kv_cache_dim * self.itemsize

    @property
    def scaled_rows(self) -> bool:
        """Whether rows are scaled fp8 rows (:class:`MLARowFormat`; MLA only), not ``kv_cache_dim`` values."""
        return False

    @property
    def row_elements(self) -> int:
        """Store-dtype elements per row, the width of the per-layer dense views: ``kv_cache_dim``, or
        ``row_bytes`` for an fp8 MLA row (a uint8 row view)."""
        return self.entry_bytes // self.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies over all layers."""
        return self.layer_num * self.entry_bytes

    @property
    def kernel_page_multiplier(self) -> int:
        """Rows per token slot of a page envelope: L (docs/design.md section 3, the dense id formula)."""
        return self.layer_num

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page envelope: ``page_size * layer_num * entry_bytes``."""
        _check_positive_int(type(self).__name__, "page_size", page_size)
        return page_size * self.token_bytes

    def _check_row_alignment(self) -> None:
        if self.entry_bytes % ALIGN:  # fp8 MLA rows are padded, so only other rows can fail this
            raise GeometryError(
                f"{type(self).__name__}: a row of kv_cache_dim={self.kv_cache_dim} x {self.itemsize} bytes = "
                f"{self.entry_bytes} bytes is not a multiple of {ALIGN}"
            )


@dataclasses.dataclass(frozen=True)
class MLASpec(_KVByteMath):
    """Latent KV of multi-head latent attention: one row of ``kv_cache_dim`` values per token per layer.

    Args:
        layer_num: number of MLA layers sharing one page envelope (L).
        kv_lora_rank: width R of the normalised latent ``kv_nope`` (512 in Kimi-Linear / DeepSeek-V3).
        qk_rope_head_dim: width Dr of the shared rope key ``k_rot`` (64).
        dtype: the KV dtype the model writes (bf16, fp16, fp32 or an fp8 format). A row is laid out as
            :attr:`row_format` says: ``kv_cache_dim`` values of a compute dtype, or a scaled fp8 row of
            ``row_format.row_bytes`` bytes (fp8 latent, fp32 tile scales, bf16 rope, padded to 16 bytes).

    Raises:
        GeometryError: a field is not a positive int, the dtype is unsupported, or a row of
            ``kv_cache_dim * itemsize`` bytes is not a multiple of 16 (rows must stay 16-byte aligned;
            fp8 rows are padded to 16 bytes, so they always are).
    """

    layer_num: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for field in ("layer_num", "kv_lora_rank", "qk_rope_head_dim"):
            _check_positive_int("MLASpec", field, getattr(self, field))
        _check_dtype("MLASpec", "dtype", self.dtype, KV_STORE_DTYPES)
        self._check_row_alignment()

    @property
    def kv_cache_dim(self) -> int:
        """D = kv_lora_rank + qk_rope_head_dim, values per row."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def row_format(self) -> MLARowFormat:
        """The byte layout of one row."""
        return MLARowFormat(self.kv_lora_rank, self.qk_rope_head_dim, self.dtype)

    @property
    def entry_bytes(self) -> int:
        """Bytes of one row: ``row_format.row_bytes`` (``D * itemsize``, or the padded fp8 row)."""
        return self.row_format.row_bytes

    @property
    def scaled_rows(self) -> bool:
        """Whether rows are scaled fp8 rows (every fp8 dtype)."""
        return self.row_format.quantized


@dataclasses.dataclass(frozen=True)
class MHASpec(_KVByteMath):
    """Per-head K and V of classic multi-head / grouped-query attention (byte math only).

    Args:
        layer_num: number of attention layers sharing one page envelope.
        num_kv_heads: KV heads per layer.
        head_dim: K width per head.
        v_head_dim: V width per head (defaults to ``head_dim``).
        dtype: KV dtype (bf16, fp16, fp32 or an fp8 format).

    Raises:
        GeometryError: a bad field, or a row of K + V that is not a multiple of 16 bytes.
    """

    layer_num: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for field in ("layer_num", "num_kv_heads", "head_dim"):
            _check_positive_int("MHASpec", field, getattr(self, field))
        if self.v_head_dim is not None:
            _check_positive_int("MHASpec", "v_head_dim", self.v_head_dim)
        _check_dtype("MHASpec", "dtype", self.dtype, KV_STORE_DTYPES)
        self._check_row_alignment()

    @property
    def k_dim(self) -> int:
        """Elements of K per token per layer (all heads)."""
        return self.num_kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        """Elements of V per token per layer (all heads)."""
        return self.num_kv_heads * (self.head_dim if self.v_head_dim is None else self.v_head_dim)

    @property
    def kv_cache_dim(self) -> int:
        """Elements per row: K then V of every head."""
        return self.k_dim + self.v_dim


@dataclasses.dataclass(frozen=True)
class StateSection:
    """One tensor of a request's state: ``shape`` elements of ``dtype``, stored contiguously."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if not self.shape:
            raise GeometryError("StateSection.shape must have at least one dimension")
        for i, d in enumerate(self.shape):
            _check_positive_int("StateSection", f"shape[{i}]", d)
        _check_dtype("StateSection", "dtype", self.dtype, frozenset(COMPUTE_DTYPES))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class LinearLayerStateSpec:
    """The state of one linear-attention layer: a short-convolution section then a recurrent section.

    KDA / Gated DeltaNet: ``conv = [conv_dim, kernel]`` in the model dtype (the last ``kernel`` raw q|k|v
    columns), ``recurrent = [H, K, V]`` fp32. Mamba2: ``conv = [conv_dim, kernel]``,
    ``recurrent = [H, head_dim, d_state]``.
    """

    conv: StateSection
    recurrent: StateSection


@dataclasses.dataclass(frozen=True)
class LinearStateSpec:
    """Per-request state of every linear-attention layer, laid out in one slot (docs/design.md section 3).

    Within a slot, for each layer in order: the conv section, then the recurrent section, each starting
    16-byte aligned. The slot pitch :attr:`slot_bytes` is the 16-byte rounded total, which is NOT
    ``H*K*V*4``: kernels address states by pitch, in int64.

    Raises:
        GeometryError: no layers, or a section with a bad shape or dtype.
    """

    layers: tuple[LinearLayerStateSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise GeometryError("LinearStateSpec.layers must hold at least one layer")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LinearLayerStateSpec):
                raise GeometryError(f"LinearStateSpec.layers[{i}] must be a LinearLayerStateSpec, got {layer!r}")

    @classmethod
    def kda(
        cls,
        layer_num: int,
        num_heads: int,
        head_dim: int,
        conv_kernel: int,
        conv_dtype: torch.dtype = torch.bfloat16,
        v_head_dim: int | None = None,
    ) -> LinearStateSpec:
        """Kimi Delta Attention (and Gated DeltaNet with equal q/k/v widths): per layer
        ``conv = [3 * H * K, conv_kernel]`` in ``conv_dtype`` and ``recurrent = [H, K, V]`` fp32."""
        _check_positive_int("LinearStateSpec.kda", "layer_num", layer_num)
        v = head_dim if v_head_dim is None else v_head_dim
        conv_dim = num_heads * (2 * head_dim + v)
        layer = LinearLayerStateSpec(
            conv=StateSection((conv_dim, conv_kernel), conv_dtype),
            recurrent=StateSection((num_heads, head_dim, v), torch.float32),
        )
        return cls((layer,) * layer_num)

    @classmethod
    def mamba2(
        cls,
        layer_num: int,
        num_heads: int,
        head_dim: int,
        d_state: int,
        n_groups: int,
        conv_kernel: int,
        conv_dtype: torch.dtype = torch.bfloat16,
    ) -> LinearStateSpec:
        """Mamba2: ``conv = [H*head_dim + 2*n_groups*d_state, conv_kernel]``, ``ssm = [H, head_dim, d_state]``
        fp32 (the layout of the Mamba2 reference implementation)."""
        _check_positive_int("LinearStateSpec.mamba2", "layer_num", layer_num)
        conv_dim = num_heads * head_dim + 2 * n_groups * d_state
        layer = LinearLayerStateSpec(
            conv=StateSection((conv_dim, conv_kernel), conv_dtype),
            recurrent=StateSection((num_heads, head_dim, d_state), torch.float32),
        )
        return cls((layer,) * layer_num)

    @property
    def layer_num(self) -> int:
        return len(self.layers)

    @functools.cached_property
    def _offsets(self) -> tuple[tuple[tuple[int, int], ...], int]:
        offset, out = 0, []
        for layer in self.layers:
            conv = round_up(offset, ALIGN)
            rec = round_up(conv + layer.conv.nbytes, ALIGN)
            offset = rec + layer.recurrent.nbytes
            out.append((conv, rec))
        return tuple(out), offset

    def conv_offset(self, layer: int) -> int:
        """Byte offset of layer ``layer``'s conv section inside a slot (16-byte aligned)."""
        return self._offsets[0][layer][0]

    def recurrent_offset(self, layer: int) -> int:
        """Byte offset of layer ``layer``'s recurrent section inside a slot (16-byte aligned)."""
        return self._offsets[0][layer][1]

    @property
    def raw_bytes(self) -> int:
        """Bytes the sections themselves hold, without alignment padding."""
        return sum(layer.conv.nbytes + layer.recurrent.nbytes for layer in self.layers)

    @property
    def slot_bytes(self) -> int:
        """The slot pitch: the laid-out total rounded up to 16 bytes."""
        return round_up(self._offsets[1], ALIGN)

