"""A state pool set up the way the slot-op tests need it (shared by test_state, test_conv and test_kda)."""

import torch

from unimem_compile.pool import ArenaLayout, UnifiedPool, state_views


def scattered_slot_pool(spec, gen, n_alloc: int, freed: slice, dead_index: int, fill_states: bool = True):
    """A pool whose live virtual slots sit at scattered physical slots (alloc, free ``ids[freed]``, compact,
    alloc two more), with random bytes everywhere past the sink (the alignment padding included), random
    finite values in every live state section when ``fill_states``, and one tombstoned id.

    Returns:
        ``(pool, live virtual ids, the tombstoned id)``.
    """
    pool = UnifiedPool(ArenaLayout.for_capacity(None, spec, 16, 0, n_alloc + 2))
    ids = pool.alloc_slots(n_alloc)
    pool.free_slots(ids[freed])
    pool.compact("state")
    ids = [s for s in ids if s not in ids[freed]] + pool.alloc_slots(2)
    floor = pool.layout.sink_floor
    pool.arena[floor:] = torch.randint(0, 256, (pool.arena.numel() - floor,), dtype=torch.uint8, generator=gen)
    if fill_states:
        for layer in range(spec.layer_num):
            for view in state_views(pool.arena, pool.layout, layer):
                live = view[pool.layout.first_slot:]
                live.copy_(torch.randn(live.shape, generator=gen).to(view.dtype))
    dead = ids.pop(dead_index)
    pool.free_slots([dead])
    return pool, ids, dead


def physical_slot(pool, s: int) -> int:
    """The physical slot of virtual ``s`` (-1 for ids outside the table)."""
    return int(pool.s_v2p[s]) if 0 <= s < pool.s_v2p.numel() else -1
