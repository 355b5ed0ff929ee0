"""The unified memory pool: specs, arena layout, the multi-ended allocator, page tables and sizing.

Plain PyTorch (no Triton, no transformers); everything here runs and is tested on a CPU.
"""

from .allocator import Move, MultiEndedAllocator
from .layout import ArenaLayout
from .page_table import PageTables
from .sizing import GEOMETRIES, geometry, max_requests, padded_group_bytes, pool_info
from .specs import (
    ALIGN,
    COMPUTE_DTYPES,
    FP8_DTYPES,
    FP8_KV_DTYPES,
    KERNEL_KV_DTYPES,
    KV_STORE_DTYPES,
    LinearLayerStateSpec,
    LinearStateSpec,
    MHASpec,
    MLARowFormat,
    MLASpec,
    StateSection,
    store_dtype_of,
)
from .translate import translate_kv_loc, translate_kv_loc_dense, translate_slot
from .unified import POISON_BYTE, PoolStats, UnifiedPool, kv_dense_views, state_views, structural_overhead

__all__ = [
    "ALIGN",
    "COMPUTE_DTYPES",
    "FP8_DTYPES",
    "FP8_KV_DTYPES",
    "GEOMETRIES",
    "KERNEL_KV_DTYPES",
    "KV_STORE_DTYPES",
    "POISON_BYTE",
    "ArenaLayout",
    "LinearLayerStateSpec",
    "LinearStateSpec",
    "MHASpec",
    "MLARowFormat",
    "MLASpec",
    "Move",
    "MultiEndedAllocator",
    "PageTables",
    "PoolStats",
    "StateSection",
    "UnifiedPool",
    "geometry",
    "kv_dense_views",
    "max_requests",
    "padded_group_bytes",
    "pool_info",
    "state_views",
    "store_dtype_of",
    "structural_overhead",
    "translate_kv_loc",
    "translate_kv_loc_dense",
    "translate_slot",
]
