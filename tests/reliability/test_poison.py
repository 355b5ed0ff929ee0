"""The debug poison mode catches a planted bad location in every op family.

``UnifiedPool(poison=True)`` (the default under ``UNIMEM_DEBUG=1``) fills free pages and slots, never the
sink, with 0xFF bytes: NaN in fp32, fp16 and bf16. Each case below plants a bug that the cheap checks
cannot see (the ids are valid, just wrong) and runs the op (reference) and its Triton launcher:

* a table captured before a compaction (a stale ``v2p`` / ``s_v2p``): the kernel follows it to the
  page or slot the data moved away from, which compaction poisoned;
* a ``kv_len`` one token too long (an off-by-one in the caller): the row past the last write was never
  written.

With poison the affected lanes (and only they) come out NaN; without poison the very same bug gives finite,
plausible numbers: stale copies or zeros. Ops that write through a stale table also leave bytes in free
memory, which the poison audit (every free byte still 0xFF) reports.

On a machine with CUDA the same plants also run on CUDA tensors, through the compiled Triton kernels:
``python -m pytest tests/reliability/test_poison.py -k cuda``.
"""

from __future__ import annotations

import pytest
import torch

from unimem_compile.ops import conv, kda, mla_decode, mla_gather, mla_prefill, mla_write, state, translate
from unimem_compile.env import triton_interpret


def _compact(w, side: str) -> list[int]:
    """Compact one side of the World's pool; returns the virtual ids that moved."""
    moves = w.pool.compact(side)
    assert moves
    return [m.virtual for m in moves]


def _geometry(w):
    return (w.KV_LAYER, w.L, w.PS, w.R, w.DR, torch.float32)


# Each plant runs ``fn`` (the op or its launcher) on a planted bug and returns (items [N, ...], bad [N]
# bool: the items the bug reaches, whether the poison audit flags it: the bug wrote finite bytes into
# free memory).
def plant_translate(w, fn):
    stale = w.pool.v2p.clone()
    moved = _compact(w, "kv")
    loc = torch.cat([w.locations(0, w.lens[0]), w.locations(1, w.lens[1])])
    dense = fn(stale, loc, w.PS, w.L)
    rows = w.pool.kv_views()[w.KV_LAYER][:, 0][dense]
    return rows, torch.isin(loc // w.PS, w.tensor(moved)), False


def plant_write(norm: bool):
    def plant(w, fn):
        stale = w.pool.v2p.clone()
        moved = _compact(w, "kv")
        assert int(w.page_table[1, 0]) in moved
        # the writer appends row 1's token 3 through the stale table; the reader then reads 4 tokens
        loc = w.locations(1, 4)[3:]
        extra = (w.randn(w.R), 1e-6) if norm else ()
        fn(w.pool.arena, stale, loc, w.randn(1, w.R), w.randn(1, w.DR), *extra, *_geometry(w))
        rows = w.pool.read_kv(w.KV_LAYER, w.locations(1, 4))
        return rows, torch.tensor([False, False, False, True]), True
    return plant


def plant_gather(w, fn):
    kv_len = w.kv_len.clone()
    kv_len[1] += 1  # off by one: token lens[1] of row 1 was never written
    offset = w.tensor([0, 2], dtype=torch.int32)
    out = fn(w.pool.arena, w.pool.v2p, w.page_table, kv_len, offset, 10, *_geometry(w))
    bad = torch.zeros(2, 10, dtype=torch.bool)
    bad[1, 2 + w.lens[1]] = True
    return out.reshape(20, -1), bad.reshape(-1), False


def plant_decode(w, fn):
    kv_len = w.kv_len.clone()
    kv_len[1] += 1
    out = fn(w.randn(2, w.H, w.R), w.randn(2, w.H, w.DR), w.pool.arena, w.pool.v2p, w.page_table, kv_len, 0.2,
             *_geometry(w))
    return out, torch.tensor([False, True]), False


def plant_prefill(w, fn):
    kv_len = w.kv_len.clone()
    kv_len[1] += 1
    # 2 new tokens per row; row 1's never-written token is the last query's own, and it lies in the key tile
    # of both of row 1's queries: the first gives it probability 0, but 0 x NaN is NaN (the reference's
    # einsum does the same), so all of row 1 and none of row 0 comes out NaN
    out = fn(w.randn(2, w.H, 2, 8 + w.DR), w.pool.arena, w.pool.v2p, w.page_table, kv_len, kv_len.cpu(),
             w.randn(w.H * 16, w.R), 0.2, 4, *_geometry(w))
    return out.transpose(1, 2).reshape(4, -1), torch.tensor([False, False, True, True]), False


def _stale_slots(w):
    """A copy of s_v2p from before a state compaction that moved lane 0's slot."""
    stale = w.pool.s_v2p.clone()
    moved = _compact(w, "state")
    ids = w.tensor(w.slots)
    assert moved == [w.slots[0]]
    return stale, ids


def plant_state_gather(w, fn):
    stale, ids = _stale_slots(w)
    out = fn(w.pool.arena, stale, ids, w.recurrent_offset(), w.slot_bytes, [w.H, w.K, w.V], torch.float32)
    return out, torch.tensor([True, False]), False


def plant_state_scatter(w, fn):
    stale, ids = _stale_slots(w)
    fn(w.pool.arena, stale, ids, w.randn(2, w.H, w.K, w.V), w.recurrent_offset(), w.slot_bytes)
    # lane 0's update went to the freed slot: the live slot still holds its old state, nothing reads NaN
    return None, None, True


def plant_conv(w, fn):
    stale, ids = _stale_slots(w)
    out = fn(w.randn(2, w.C), w.pool.arena, stale, ids, w.conv_offset(), w.slot_bytes, w.randn(w.C, w.CONV_K),
             w.randn(w.C), "silu")
    return out, torch.tensor([True, False]), True


def _kda_inputs(w, t):
    lead = (2,) if t is None else (2, t)
    return (w.randn(*lead, w.H, w.K), w.randn(*lead, w.H, w.K), w.randn(*lead, w.H, w.V),
            -w.rand(*lead, w.H, w.K) - 0.05, w.rand(*lead, w.H))


def plant_kda(t):
    def plant(w, fn):
        stale, ids = _stale_slots(w)
        out = fn(*_kda_inputs(w, t), w.pool.arena, stale, ids, w.recurrent_offset(), w.slot_bytes, w.K ** -0.5, True)
        # the stale table makes the kernel write a NaN state back into the freed slot. Whether the byte audit
        # sees that write depends on the platform: x86 propagates the poison's NaN payload (0xFFFFFFFF, bytes
        # unchanged) while CUDA writes the canonical NaN 0x7FFFFFFF (seen on an H200). The NaN output is what
        # catches the bug on both, so the audit is not asserted here.
        return out, torch.tensor([True, False]), None
    return plant


def plant_kda_chunk(w, fn):
    # the Kimi-Linear adapter's path: the initial state is gathered from the slot, then chunked KDA runs
    stale, ids = _stale_slots(w)
    initial = state.gather_sections(w.pool.arena, stale, ids, w.recurrent_offset(), w.slot_bytes,
                                    [w.H, w.K, w.V], torch.float32)
    out, final = fn(*_kda_inputs(w, 3), initial, w.K ** -0.5, True)
    return torch.cat([out.reshape(2, -1), final.reshape(2, -1)], 1), torch.tensor([True, False]), False


PLANTS = {
    "translate_kv_loc_dense": (plant_translate, torch.ops.unimem.translate_kv_loc_dense,
                               translate.translate_kv_loc_dense_triton),
    "mla_kv_write": (plant_write(False), torch.ops.unimem.mla_kv_write, mla_write.mla_kv_write_triton),
    "mla_kv_write_rmsnorm": (plant_write(True), torch.ops.unimem.mla_kv_write_rmsnorm,
                             mla_write.mla_kv_write_rmsnorm_triton),
    "mla_gather": (plant_gather, torch.ops.unimem.mla_gather, mla_gather.mla_gather_triton),
    "mla_decode": (plant_decode, torch.ops.unimem.mla_decode, mla_decode.mla_decode_triton),
    "mla_prefill": (plant_prefill, torch.ops.unimem.mla_prefill, mla_prefill.mla_prefill_triton),
    "state_gather": (plant_state_gather, torch.ops.unimem.state_gather, state.state_gather_triton),
    "state_scatter": (plant_state_scatter, torch.ops.unimem.state_scatter, state.state_scatter_triton),
    "causal_conv1d_update": (plant_conv, torch.ops.unimem.causal_conv1d_update, conv.causal_conv1d_update_triton),
    "kda_decode": (plant_kda(None), torch.ops.unimem.kda_decode, kda.kda_decode_triton),
    "kda_prefill": (plant_kda(3), torch.ops.unimem.kda_prefill, kda.kda_prefill_cuda),
    "kda_chunk": (plant_kda_chunk, torch.ops.unimem.kda_chunk, None),
}
#: (family, entry, device): on the CPU the op (its reference) and the launcher (Triton interpreter); on CUDA
#: the op, which dispatches to the compiled Triton kernel through its launcher
CASES = [(f, e, "cpu") for f, (_, op, launcher) in PLANTS.items() for e in ("op", "launcher") if e == "op" or launcher]
CASES += [(f, "op", "cuda") for f in PLANTS]


@pytest.mark.parametrize("family,entry,device", CASES, ids=["-".join(c) for c in CASES])
def test_poison_turns_a_planted_bad_location_into_nan_only_where_it_reaches(family, entry, device, make_world,
                                                                            poison_audit):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if device == "cpu" and entry == "launcher" and not triton_interpret():
        pytest.skip("CPU tensors reach the Triton launchers only under TRITON_INTERPRET=1")
    plant, op, launcher = PLANTS[family]
    fn = op if entry == "op" else launcher
    poisoned, clean = make_world(poison=True, device=device), make_world(poison=False, device=device)
    items, bad, audit_flags = plant(poisoned, fn)
    if audit_flags is not None:
        assert poison_audit(poisoned.pool) == (not audit_flags)
    if items is not None:
        nan, bad = items.reshape(bad.numel(), -1).isnan().cpu(), bad.cpu()
        assert torch.equal(nan.all(-1), bad) and torch.equal(nan.any(-1), bad)
        # without poison the same bug is silent: finite numbers that look like data
        items, _, _ = plant(clean, fn)
        assert bool(items.isfinite().all())
