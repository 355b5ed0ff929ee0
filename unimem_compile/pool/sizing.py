"""Sizing: model geometry + budget -> capacity figures, computed without allocating.

``pool_info`` answers "what fits in this budget" for a geometry (the real Kimi-Linear-48B-A3B one sizes a
40 GiB arena on a machine with far less memory), and compares one request's footprint with a hybrid
allocator that pads attention blocks to the state size.
"""

from __future__ import annotations

import math

import torch

from ..errors import GeometryError
from .layout import ArenaLayout, KVSpec
from .specs import LinearStateSpec, MLASpec, round_up
from .unified import structural_overhead

__all__ = [
    "GEOMETRIES",
    "geometry",
    "max_requests",
    "padded_block_geometry",
    "padded_group_bytes",
    "pool_info",
]


def _kimi_linear_48b() -> tuple[KVSpec, LinearStateSpec]:
    # Kimi-Linear-48B-A3B: 27 layers = 7 MLA (kv_lora_rank 512 + qk_rope_head_dim 64, bf16) + 20 KDA
    # (32 heads x 128 x 128 fp32 recurrent state, short conv of kernel 4 over 3 x 32 x 128 channels, bf16)
    return MLASpec(7, 512, 64, torch.bfloat16), LinearStateSpec.kda(20, 32, 128, 4, torch.bfloat16)


def _deepseek_v3() -> tuple[KVSpec, None]:
    # DeepSeek-V3: 61 MLA layers, no linear attention
    return MLASpec(61, 512, 64, torch.bfloat16), None


#: Named geometries for ``unimem-compile pool-info --geometry``.
GEOMETRIES = {"kimi-linear-48b": _kimi_linear_48b, "deepseek-v3": _deepseek_v3}


def geometry(name: str) -> tuple[KVSpec | None, LinearStateSpec | None]:
    """The ``(kv, state)`` specs of a named geometry; ValueError listing the names otherwise."""
    try:
        return GEOMETRIES[name]()
    except KeyError:
        raise ValueError(f"unknown geometry {name!r}; known: {', '.join(sorted(GEOMETRIES))}") from None


def max_requests(layout: ArenaLayout, tokens_per_request: int) -> int:
    """How many requests of ``tokens_per_request`` tokens (one slot each) fit together in ``layout``."""
    pages = -(-tokens_per_request // layout.page_size) if layout.kv is not None else 0
    slots = 1 if layout.state is not None else 0
    lo, hi = 0, max(layout.num_pages, layout.num_slots) + 1
    while lo < hi:  # largest n with fits(n * pages, n * slots)
        mid = (lo + hi + 1) // 2
        if layout.fits(mid * pages, mid * slots):
            lo = mid
        else:
            hi = mid - 1
    return lo


def padded_block_geometry(kv: MLASpec, state: LinearStateSpec, kernel_block: int = 16) -> dict[str, int]:
    """The page geometry of :func:`padded_group_bytes`'s hybrid allocator model.

    Returns:
        ``block_tokens`` (attention tokens per page), ``page_bytes`` (one page, = the per-layer state
        rounded up to whole ``kernel_block``-token attention rows), ``attn_layers`` and ``linear_layers``
        (each kind padded to whole groups of ``min(#attention, #linear)`` layers).

    Raises:
        GeometryError: a missing spec, or ``kernel_block`` not a positive int.
    """
    if kv is None or state is None:
        raise GeometryError("the padded hybrid model needs both a KV and a state spec (a hybrid geometry)")
    if isinstance(kernel_block, bool) or not isinstance(kernel_block, int) or kernel_block <= 0:
        raise GeometryError(f"kernel_block must be a positive number of tokens, got {kernel_block!r}")
    per_layer_state = state.slot_bytes // state.layer_num
    block = round_up(-(-per_layer_state // kv.entry_bytes), kernel_block)
    group = min(kv.layer_num, state.layer_num)
    return {
        "block_tokens": block,
        "page_bytes": block * kv.entry_bytes,
        "attn_layers": -(-kv.layer_num // group) * group,
        "linear_layers": -(-state.layer_num // group) * group,
    }


def padded_group_bytes(kv: KVSpec | None, state: LinearStateSpec | None, tokens: int, kernel_block: int = 16) -> int:
    """Bytes one request of ``tokens`` tokens takes in a hybrid allocator with one page size for every layer.

    The model (vLLM v1's hybrid KV-cache manager as it handles Mamba-style layers): every layer's page has
    the same byte size, the per-layer state (conv + recurrent) of a linear layer; the attention block size
    is the smallest multiple of ``kernel_block`` tokens whose per-layer rows fill that page; layers are
    grouped in groups of as many layers as the smaller kind has, so the larger kind is padded to whole
    groups. A request takes ``ceil(tokens / block)`` pages per attention layer and one page per linear layer
    (:func:`padded_block_geometry`).
    """
    if kv is None or state is None:
        raise ValueError("padded_group_bytes models a hybrid geometry: give both a KV and a state spec")
    geo = padded_block_geometry(kv, state, kernel_block)
    pages = geo["attn_layers"] * -(-tokens // geo["block_tokens"]) + geo["linear_layers"]
    return pages * geo["page_bytes"]


def pool_info(
    kv: KVSpec | None,
    state: LinearStateSpec | None,
    budget_bytes: int,
    page_size: int = 64,
    geometry_name: str = "custom",
) -> dict:
    """Capacity report of one arena (the ``pool-info --json`` keys of docs/design.md section 5).

    Returns a dict: ``geometry``, ``budget_bytes``, ``page_size``, ``page_bytes``, ``slot_bytes``,
    ``max_kv_tokens``, ``max_state_slots``, ``overhead_fraction`` (sink + tail pad + bytes past the last page
    + worst-case slot alignment padding, over the budget), ``mixes`` (max concurrent requests of 4k, 32k and
    128k tokens, each with its state), and ``request_4096`` (bytes one 4096-token request needs, the bytes
    this pool allocates for it (page rounding only), and what a padded hybrid allocator allocates, see
    :func:`padded_group_bytes`).

    Raises:
        GeometryError: the budget cannot hold the sink, the tail pad, one page and one slot.
    """
    layout = ArenaLayout(int(budget_bytes), page_size, kv, state)
    tokens = 4096
    need = (tokens * kv.token_bytes if kv else 0) + (state.raw_bytes if state else 0)
    alloc = (math.ceil(tokens / page_size) * layout.page_bytes if kv else 0) + layout.slot_bytes
    info = {
        "geometry": geometry_name,
        "budget_bytes": layout.memory_budget,
        "page_size": page_size,
        "page_bytes": layout.page_bytes,
        "slot_bytes": layout.slot_bytes,
        "max_kv_tokens": layout.max_kv_tokens,
        "max_state_slots": layout.max_state_slots,
        "overhead_fraction": structural_overhead(layout) / layout.memory_budget,
        "mixes": [
            {"tokens_per_request": t, "max_requests": max_requests(layout, t)} for t in (4096, 32768, 131072)
        ],
        "request_4096": {
            "bytes_needed": need,
            "bytes_allocated": alloc,
            "padded_group_bytes_allocated": padded_group_bytes(kv, state, tokens) if kv and state else alloc,
        },
    }
    return info
