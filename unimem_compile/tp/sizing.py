"""Per-rank pool sizing under tensor parallelism, without allocating (``unimem-compile pool-info --tp N``).

A rank's arena holds the FULL latent rows (the MLA latent has no head dimension: every rank reads all 576
values of a token for its heads), so the KV spec is unchanged; its state slots hold only its KDA heads: each
linear layer's conv section ``[conv_dim / N, kernel]`` and recurrent section ``[H / N, K, V]``.
"""

from __future__ import annotations

from ..errors import GeometryError
from ..pool.layout import KVSpec
from ..pool.sizing import pool_info
from ..pool.specs import LinearLayerStateSpec, LinearStateSpec, StateSection

__all__ = ["shard_state_spec", "pool_info_tp"]


def shard_state_spec(state: LinearStateSpec | None, world_size: int) -> LinearStateSpec | None:
    """The state spec of one rank out of ``world_size``: every layer's conv channels and recurrent heads
    divided by ``world_size`` (None stays None; ``world_size`` 1 returns ``state``).

    Raises:
        GeometryError: ``world_size`` is not a positive int, or does not divide a layer's conv channels or
            heads (the message names the layer and the count)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise GeometryError(f"the tensor-parallel degree must be a positive int, got {world_size!r}")
    if state is None or world_size == 1:
        return state
    layers = []
    for i, layer in enumerate(state.layers):
        (channels, kernel), (heads, *rest) = layer.conv.shape, layer.recurrent.shape
        if channels % world_size or heads % world_size:
            raise GeometryError(f"linear layer {i} has {heads} heads and {channels} conv channels, which do not "
                                f"divide over {world_size} ranks")
        layers.append(LinearLayerStateSpec(
            conv=StateSection((channels // world_size, kernel), layer.conv.dtype),
            recurrent=StateSection((heads // world_size, *rest), layer.recurrent.dtype)))
    return LinearStateSpec(tuple(layers))


def pool_info_tp(kv: KVSpec | None, state: LinearStateSpec | None, budget_bytes: int, page_size: int,
                 world_size: int, geometry_name: str = "custom") -> dict:
    """:func:`~unimem_compile.pool.sizing.pool_info` of ONE rank's arena of ``budget_bytes`` when the model is
    cut over ``world_size`` ranks (full latent rows, 1/N of every state), plus ``"tp": world_size``.

    Raises:
        GeometryError: as :func:`shard_state_spec` and ``pool_info``."""
    info = pool_info(kv, shard_state_spec(state, world_size), budget_bytes, page_size, geometry_name=geometry_name)
    info["tp"] = world_size
    return info
