"""Shared setup of the reliability tests: a small pool with both sides in use (``World``), the checks
"nothing changed" (``World.snapshot`` / ``World.assert_unchanged``) and "every free byte is still poison"
(``poison_audit``), and one intra-op thread per test.

The World's pool holds random finite latent rows on scattered live pages (one page tombstoned) and random
finite states in scattered live slots (one slot tombstoned). Everything else past the sink is poison
(0xFF bytes, NaN in every float dtype) unless the World is built with ``poison=False``. Test modules reach
all of it through fixtures: under ``--import-mode=importlib`` they cannot import this file.
"""

from __future__ import annotations

import copy

import pytest
import torch

from unimem_compile.pool import POISON_BYTE, ArenaLayout, LinearStateSpec, MLASpec, UnifiedPool

# MLA geometry: L layers of R + DR fp32 values per row, PS tokens per page
L, R, DR, PS = 2, 32, 16, 4
# KDA geometry: H heads of K x V fp32 states, a short conv of CONV_K taps over C = H * (2K + V) channels
H, K, V, CONV_K = 2, 8, 8, 4
C = H * (2 * K + V)
KV_LAYER = 1
STATE_LAYER = 1


class World:
    """A pool (poisoned unless ``poison=False``, on ``device``) with live and tombstoned pages and slots on
    both sides.

    Attributes:
        pool: the UnifiedPool (fp32 KV rows, fp32 conv and recurrent states).
        lens: tokens of the two page-table rows: row 0 holds ``lens[0]`` tokens on two pages, row 1
            ``lens[1]`` on one (its last token slot never written).
        page_table: int32 ``[2, 3]`` virtual pages of the rows (-1 = none); ``kv_len`` int32 ``[2]``.
        slots: live virtual slots, one per row; ``dead_page`` / ``dead_slot``: tombstoned virtual ids.
    """

    L, R, DR, PS = L, R, DR, PS
    H, K, V, CONV_K, C = H, K, V, CONV_K, C
    KV_LAYER, STATE_LAYER = KV_LAYER, STATE_LAYER

    def __init__(self, seed: int = 0, poison: bool = True, device: str = "cpu"):
        self.gen = torch.Generator().manual_seed(seed)
        self.device = torch.device(device)
        self.kv_spec = MLASpec(L, R, DR, torch.float32)
        self.state_spec = LinearStateSpec.kda(2, H, K, CONV_K, torch.float32)
        self.pool = UnifiedPool(ArenaLayout.for_capacity(self.kv_spec, self.state_spec, PS, 10, 5), self.device,
                                poison=poison)
        pool = self.pool
        pages = pool.alloc_pages(5)
        slots = pool.alloc_slots(4)
        self.dead_page, self.dead_slot = pages[1], slots[0]
        pool.free_pages([self.dead_page])
        pool.free_slots([self.dead_slot])
        self.pages = [p for p in pages if p != self.dead_page]
        self.slots = [s for s in slots if s != self.dead_slot][::-1][:2]  # physical order reversed
        self.lens = [PS + 3, PS - 1]
        self.page_table = torch.tensor([[self.pages[2], self.pages[0], -1], [self.pages[3], -1, -1]],
                                       dtype=torch.int32, device=self.device)
        self.kv_len = torch.tensor(self.lens, dtype=torch.int32, device=self.device)
        # every token of every row, all layers: random finite rows; the pages' other tokens stay poison
        for b, n in enumerate(self.lens):
            loc = self.locations(b, n)
            for layer in range(L):
                pool.write_kv(layer, loc, self.randn(n, R + DR))
        for layer in range(self.state_spec.layer_num):
            for view in pool.state_views(layer):
                for s in self.live_slots():
                    p = int(pool.physical_slots([s])[0])
                    view[p] = self.randn(*view.shape[1:])

    # ---- helpers
    def randn(self, *shape, dtype=torch.float32) -> torch.Tensor:
        """Standard normal values on the World's device (drawn on the CPU: the same on every device)."""
        return torch.randn(*shape, generator=self.gen).to(self.device, dtype)

    def rand(self, *shape) -> torch.Tensor:
        return torch.rand(*shape, generator=self.gen).to(self.device)

    def tensor(self, data, dtype=None) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def live_slots(self) -> list[int]:
        return self.pool.allocator.live_virtual("state")

    def locations(self, row: int, n: int) -> torch.Tensor:
        """Virtual locations of tokens ``0 .. n-1`` of page-table row ``row``."""
        pages = self.page_table[row].long()
        i = torch.arange(n, device=self.device)
        return pages[i // PS] * PS + i % PS

    @property
    def slot_bytes(self) -> int:
        return self.pool.layout.slot_bytes

    def conv_offset(self) -> int:
        return self.state_spec.conv_offset(STATE_LAYER)

    def recurrent_offset(self) -> int:
        return self.state_spec.recurrent_offset(STATE_LAYER)

    # ---- the "nothing changed" check
    def snapshot(self) -> dict:
        """Clones of the arena and all four tables, and the allocator's bookkeeping."""
        pool = self.pool
        return {
            "arena": pool.arena.clone(),
            "v2p": pool.v2p.clone(),
            "p2v": pool.p2v.clone(),
            "s_v2p": pool.s_v2p.clone(),
            "s_p2v": pool.s_p2v.clone(),
            "page_table": self.page_table.clone(),
            "kv_len": self.kv_len.clone(),
            "allocator": (copy.deepcopy(pool.allocator.kv.__dict__), copy.deepcopy(pool.allocator.state.__dict__)),
        }

    def assert_unchanged(self, before: dict) -> None:
        after = self.snapshot()
        for name, was in before.items():
            now = after[name]
            if name == "allocator":
                for side_was, side_now in zip(was, now):
                    assert side_was.keys() == side_now.keys()
                    for key in side_was:
                        a, b = side_was[key], side_now[key]
                        same = (a == b).all() if hasattr(a, "shape") else a == b
                        assert same, f"allocator field {key} changed"
            else:
                assert torch.equal(was, now), f"{name} changed"


def free_bytes_poisoned(pool: UnifiedPool) -> bool:
    """Whether every arena byte past the sink that no live page or live slot covers is still poison, and
    the sink is still zero: a write to a freed or never-allocated place breaks this."""
    lay = pool.layout
    free = torch.ones(lay.memory_budget, dtype=torch.bool, device=pool.arena.device)
    free[: lay.sink_floor] = False
    for v in pool.allocator.live_virtual("kv"):
        p = int(pool.allocator.kv.v2p[v])
        free[p * lay.page_bytes: (p + 1) * lay.page_bytes] = False
    for v in pool.allocator.live_virtual("state"):
        s = int(pool.allocator.state.v2p[v])
        free[s * lay.slot_bytes: (s + 1) * lay.slot_bytes] = False
    sink_zero = not bool(pool.arena[: lay.sink_floor].any())
    return sink_zero and bool((pool.arena[free] == POISON_BYTE).all())


@pytest.fixture(autouse=True)
def one_thread():
    """Every tensor here is tiny: one intra-op thread is faster than two, and much faster on a loaded CI
    machine, where waking a second thread for a 5 KB index_put costs milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def world() -> World:
    return World()


@pytest.fixture
def make_world():
    """The World class: ``make_world(seed, poison=..., device=...)`` builds a fresh one (same seed, same
    bytes)."""
    return World


@pytest.fixture
def poison_audit():
    """:func:`free_bytes_poisoned` (test modules cannot import from conftest under importlib mode)."""
    return free_bytes_poisoned
