"""The MLA geometry: the argument tail every MLA op of the ``unimem`` namespace ends with.

``mla_kv_write``, ``mla_kv_write_rmsnorm``, ``mla_gather`` and ``mla_decode`` all end their schemas with the
same six arguments (docs/design.md section 4; the schemas themselves are frozen)::

    (layer, layer_num, page_size, kv_lora_rank, qk_rope_head_dim, kv_dtype)

which say where one layer's latent rows lie in a page envelope (docs/design.md section 3: the row of token
``t`` in layer ``l`` is ``v2p[t // ps] * ps * L + l * ps + t % ps``, counted in rows of ``row_bytes`` bytes
from byte 0: ``R + Dr`` values of ``kv_dtype``, or for an fp8 ``kv_dtype`` the scaled row of
:class:`~unimem_compile.pool.specs.MLARowFormat`). :class:`MLAGeometry` is that tail as one value: the cache builds it from its pool's spec, the
launchers and references unpack their arguments into it, and the passes rebuild it from a node's
arguments bound by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from unimem_compile.pool import MLARowFormat, MLASpec

__all__ = ["MLAGeometry"]


@dataclasses.dataclass(frozen=True)
class MLAGeometry:
    """The six geometry arguments of an MLA op, in schema order.

    Attributes:
        layer: the MLA layer's index inside a page envelope, ``[0, layer_num)``.
        layer_num: MLA layers per page envelope (L).
        page_size: tokens per page (ps).
        kv_lora_rank: R, the latent (``kv_nope``) width in elements.
        qk_rope_head_dim: Dr, the rope key width in elements.
        kv_dtype: the dtype rows are stored in (one of ``KERNEL_KV_DTYPES`` for the ops: a compute dtype,
            or an fp8 format whose rows are scaled, :class:`~unimem_compile.pool.specs.MLARowFormat`).

    No checks here: the launchers check a geometry against their arena (``check_mla_geometry``), with
    the numbers in the message; the values may also be graph nodes when a pass rebuilds a call.
    """

    layer: int
    layer_num: int
    page_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    kv_dtype: torch.dtype

    #: The schema's names of the six arguments, in order.
    NAMES: ClassVar[tuple[str, ...]] = ("layer", "layer_num", "page_size", "kv_lora_rank", "qk_rope_head_dim",
                                        "kv_dtype")

    @classmethod
    def of(cls, spec: MLASpec, page_size: int, layer: int = 0) -> MLAGeometry:
        """The geometry of layer ``layer`` of a pool whose KV sub-pool is ``spec``, with pages of
        ``page_size`` tokens."""
        return cls(layer, spec.layer_num, page_size, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.dtype)

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> MLAGeometry:
        """The geometry among an MLA op's arguments bound by name (KeyError naming a missing one)."""
        return cls(*(arguments[name] for name in cls.NAMES))

    def args(self) -> tuple:
        """The six values in schema order, to splice into an op call: ``op(..., *geometry.args())``."""
        return (self.layer, self.layer_num, self.page_size, self.kv_lora_rank, self.qk_rope_head_dim, self.kv_dtype)

    def for_layer(self, layer: int) -> MLAGeometry:
        """The same geometry for envelope layer ``layer``."""
        return dataclasses.replace(self, layer=layer)

    @property
    def row_width(self) -> int:
        """Values per latent row, ``R + Dr`` (the last dimension of what ``mla_gather`` returns)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def row_format(self) -> MLARowFormat:
        """The byte layout of one row (offsets of the latent, the fp8 scales and the rope)."""
        return MLARowFormat(self.kv_lora_rank, self.qk_rope_head_dim, self.kv_dtype)

    @property
    def quantized(self) -> bool:
        """Whether rows are scaled fp8 rows."""
        return self.row_format.quantized

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype rows are read in (``mla_gather``'s result): ``kv_dtype``, bf16 for fp8 rows."""
        return self.row_format.compute_dtype

    @property
    def row_bytes(self) -> int:
        """Bytes per latent row: ``(R + Dr) * itemsize(kv_dtype)``, or the padded fp8 row's size."""
        return self.row_format.row_bytes
