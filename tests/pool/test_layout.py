"""Specs and the arena layout: the frozen numbers of docs/design.md section 3."""

import math

import pytest
import torch

from unimem_compile.errors import GeometryError
from unimem_compile.pool import (
    FP8_DTYPES,
    ArenaLayout,
    LinearStateSpec,
    MHASpec,
    MLASpec,
    UnifiedPool,
    kv_dense_views,
    state_views,
)
from unimem_compile.pool.layout import budget_for


def test_mla_spec_byte_math():
    spec = MLASpec(7, 512, 64, torch.bfloat16)
    assert spec.kv_cache_dim == 576
    assert spec.entry_bytes == 1152
    assert spec.token_bytes == 7 * 1152
    assert spec.page_bytes(64) == 64 * 7 * 576 * 2
    assert spec.store_dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", sorted(FP8_DTYPES, key=str))
def test_fp8_mla_rows_are_scaled_uint8_rows_of_656_bytes(dtype):
    # 512 fp8 latents, 4 fp32 scales (one per 128), 64 bf16 rope values: FlashMLA's fp8 KV row
    spec = MLASpec(7, 512, 64, dtype)
    fmt = spec.row_format
    assert spec.store_dtype == torch.uint8 and spec.scaled_rows
    assert (fmt.scale_offset, fmt.num_scales, fmt.rope_offset, fmt.row_bytes) == (512, 4, 528, 656)
    assert spec.entry_bytes == spec.row_elements == 656 and spec.kv_cache_dim == 576
    assert spec.page_bytes(64) == 64 * 7 * 656
    assert fmt.compute_dtype == fmt.rope_dtype == torch.bfloat16


@pytest.mark.parametrize("r, dr, offsets", [
    (64, 16, (64, 1, 68, 112)),      # the tiny models: one scale for 64 values, 100 bytes padded to 112
    (200, 8, (200, 2, 208, 224)),    # a partial last tile
    (130, 64, (132, 2, 140, 272)),   # R not a multiple of 4: the scales start 4-byte aligned
])
def test_fp8_row_offsets_for_other_ranks(r, dr, offsets):
    fmt = MLASpec(1, r, dr, torch.float8_e4m3fn).row_format
    assert (fmt.scale_offset, fmt.num_scales, fmt.rope_offset, fmt.row_bytes) == offsets


def test_unscaled_rows_keep_their_byte_math():
    for dtype, isz in ((torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)):
        spec = MLASpec(7, 512, 64, dtype)
        fmt = spec.row_format
        assert not spec.scaled_rows and fmt.num_scales == 0 and fmt.compute_dtype == dtype
        assert spec.entry_bytes == fmt.row_bytes == 576 * isz and fmt.rope_offset == 512 * isz
    # fp8 MHA rows (byte math only) stay one byte per value
    assert MHASpec(2, 4, 64, dtype=torch.float8_e4m3fn).entry_bytes == 512


def test_mha_spec_byte_math():
    spec = MHASpec(4, num_kv_heads=8, head_dim=128, v_head_dim=64, dtype=torch.float16)
    assert spec.kv_cache_dim == 8 * 128 + 8 * 64
    assert spec.entry_bytes == (8 * 128 + 8 * 64) * 2
    assert spec.page_bytes(16) == 16 * 4 * spec.entry_bytes


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: MLASpec(0, 512, 64), "layer_num"),
        (lambda: MLASpec(2, -1, 64), "kv_lora_rank"),
        (lambda: MLASpec(2, 512, 64, torch.int32), "dtype"),
        (lambda: MLASpec(2, 3, 2, torch.bfloat16), "multiple of 16"),
        (lambda: MHASpec(2, 0, 64), "num_kv_heads"),
        (lambda: LinearStateSpec(()), "at least one layer"),
        (lambda: LinearStateSpec.kda(2, 4, 0, 4), "shape"),
    ],
)
def test_invalid_geometry_names_the_field(make, field):
    with pytest.raises(GeometryError, match=field):
        make()


def test_geometry_error_is_a_value_error():
    assert issubclass(GeometryError, ValueError)


def test_kda_slot_sections_are_aligned_and_the_pitch_is_not_hkv4():
    # conv of 3 x 3 x 5 channels x kernel 3 in bf16 = 270 bytes: not a multiple of 16
    spec = LinearStateSpec.kda(3, num_heads=3, head_dim=5, conv_kernel=3, conv_dtype=torch.bfloat16)
    conv_bytes, rec_bytes = 45 * 3 * 2, 3 * 5 * 5 * 4
    offsets = []
    for layer in range(3):
        c, r = spec.conv_offset(layer), spec.recurrent_offset(layer)
        assert c % 16 == 0 and r % 16 == 0
        assert r >= c + conv_bytes
        offsets.append((c, r))
    # sections follow each other in layer order, each at the next 16-byte boundary
    assert offsets[0] == (0, 272)
    assert offsets[1][0] == math.ceil((272 + rec_bytes) / 16) * 16
    assert spec.slot_bytes % 16 == 0 and spec.slot_bytes >= offsets[2][1] + rec_bytes
    assert spec.slot_bytes != 3 * 5 * 5 * 4
    assert spec.raw_bytes == 3 * (conv_bytes + rec_bytes)


def _layout(ps=4, budget=None, L=3):
    kv = MLASpec(L, 32, 16, torch.float32)  # row = 48 * 4 = 192 bytes
    st = LinearStateSpec.kda(2, 2, 8, 4, torch.float32)
    if budget is None:
        return ArenaLayout.for_capacity(kv, st, ps, 12, 5)
    return ArenaLayout(budget, ps, kv, st)


def test_layout_numbers_follow_the_frozen_formulas():
    lay = _layout(ps=4, budget=100_000)
    page_bytes = 4 * 3 * 48 * 4
    slot = lay.state.slot_bytes
    assert lay.page_bytes == page_bytes
    assert lay.tail_pad == page_bytes
    assert lay.usable == 100_000 - page_bytes
    assert lay.num_pages == lay.usable // page_bytes
    assert lay.num_slots == lay.usable // slot
    assert lay.sink_floor == math.ceil(max(page_bytes, slot) / 16) * 16
    assert lay.first_page == math.ceil(lay.sink_floor / page_bytes)
    assert lay.first_slot == math.ceil(lay.sink_floor / slot)


def test_for_capacity_is_the_smallest_budget_that_fits():
    kv = MLASpec(3, 32, 16, torch.float32)
    st = LinearStateSpec.kda(2, 2, 8, 4, torch.float32)
    for ps, n_pages, n_slots in [(1, 40, 3), (4, 12, 5), (64, 3, 2), (16, 1, 9)]:
        lay = ArenaLayout.for_capacity(kv, st, ps, n_pages, n_slots)
        assert lay.fits(n_pages, n_slots)
        smaller = ArenaLayout(lay.memory_budget - 1, ps, kv, st)
        assert not smaller.fits(n_pages, n_slots)


def test_budget_below_the_minimum_names_the_minimum():
    kv = MLASpec(3, 32, 16, torch.float32)
    st = LinearStateSpec.kda(2, 2, 8, 4, torch.float32)
    minimum = ArenaLayout.minimum_budget(kv, st, 4)
    ArenaLayout(minimum, 4, kv, st)
    with pytest.raises(GeometryError, match=f"minimum {minimum} bytes"):
        ArenaLayout(minimum - 1, 4, kv, st)


@pytest.mark.parametrize("ps", [1, 4, 64])
def test_dense_row_of_layer_l_lands_at_the_page_major_offset(ps):
    L, D = 3, 48
    kv = MLASpec(L, 32, 16, torch.float32)
    st = LinearStateSpec.kda(1, 2, 8, 4, torch.float32)
    pool = UnifiedPool(ArenaLayout.for_capacity(kv, st, ps, 6, 2))
    pages = pool.alloc_pages(4)
    g = torch.Generator().manual_seed(ps)
    flat = pool.arena[: pool.layout.num_pages * pool.layout.page_bytes].view(torch.float32)
    for vp in pages:
        p = pool.physical_pages([vp])[0]
        for s in {0, ps // 2, ps - 1}:
            t = torch.tensor([vp * ps + s])
            for layer in range(L):
                row = torch.randn(1, D, generator=g)
                pool.write_kv(layer, t, row)
                off = p * L * ps * D + layer * ps * D + s * D
                assert torch.equal(flat[off : off + D], row[0])
                assert torch.equal(pool.read_kv(layer, t), row)


def test_layers_never_alias_at_the_same_id():
    ps, L = 4, 3
    pool = UnifiedPool(_layout(ps=ps, L=L))
    pages = pool.alloc_pages(3)
    t = torch.tensor([p * ps + s for p in pages for s in range(ps)])
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(len(t), 48, generator=g) for _ in range(L)]
    for layer in range(L):
        pool.write_kv(layer, t, rows[layer])
    for layer in range(L):
        assert torch.equal(pool.read_kv(layer, t), rows[layer])


def test_dense_views_need_the_tail_pad():
    lay = _layout(ps=4, budget=50_000)
    views = kv_dense_views(torch.zeros(lay.memory_budget, dtype=torch.uint8), lay)
    last = views[-1]
    # the last layer's view ends (L-1)*ps rows past the last page, inside the tail pad
    end = (last.storage_offset() + last.shape[0] * 48) * 4
    assert end == lay.num_pages * lay.page_bytes + (lay.layer_num - 1) * lay.page_size * 48 * 4
    assert lay.num_pages * lay.page_bytes < end <= lay.memory_budget
    short = torch.zeros(end - 1, dtype=torch.uint8)
    with pytest.raises(GeometryError, match=f"need {end} bytes"):
        kv_dense_views(short, lay)


def test_state_views_address_slots_by_pitch():
    lay = _layout(ps=4)
    pool = UnifiedPool(lay)
    slots = pool.alloc_slots(3)
    phys = pool.physical_slots(slots)
    g = torch.Generator().manual_seed(3)
    spec = lay.state
    for layer in range(spec.layer_num):
        conv, rec = pool.state_views(layer)
        assert conv.shape == (lay.num_slots, *spec.layers[layer].conv.shape)
        assert rec.shape == (lay.num_slots, *spec.layers[layer].recurrent.shape)
        values = torch.randn(rec[phys].shape, generator=g)
        rec[phys] = values
        for i, p in enumerate(phys.tolist()):
            start = p * lay.slot_bytes + spec.recurrent_offset(layer)
            raw = pool.arena[start : start + values[i].numel() * 4].view(torch.float32)
            assert torch.equal(raw, values[i].reshape(-1))
    with pytest.raises(GeometryError, match="out of range"):
        state_views(pool.arena, lay, 2)


@pytest.mark.parametrize("dtype", sorted(FP8_DTYPES, key=str))
def test_fp8_round_trip_through_the_pool_is_bit_exact(dtype):
    kv = MLASpec(2, 64, 16, dtype)
    st = LinearStateSpec.kda(1, 2, 8, 4, torch.float32)
    pool = UnifiedPool(ArenaLayout.for_capacity(kv, st, 16, 4, 1))
    pages = pool.alloc_pages(2)
    t = torch.tensor([pages[0] * 16 + 3, pages[1] * 16 + 15, pages[0] * 16])
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(0, 256, (3, 112), dtype=torch.uint8, generator=g)  # every byte pattern incl. NaNs
    pool.write_kv(1, t, bits)
    back = pool.read_kv(1, t)
    assert back.dtype == torch.uint8 and back.shape == (3, 112)  # a scaled row mixes formats: bytes
    assert torch.equal(back, bits)
    assert pool.kv_views()[1].shape[1:] == (1, 112) and pool.kv_views()[1].dtype == torch.uint8
    with pytest.raises(TypeError, match="rows must be torch.uint8"):
        pool.write_kv(1, t, bits.view(dtype))
    with pytest.raises(GeometryError, match=r"rows must be \[3, 112\]"):
        pool.write_kv(1, t, bits[:, :80])


def test_budget_for_without_pages_or_without_states():
    kv = MLASpec(2, 32, 16, torch.float32)
    lay = ArenaLayout.for_capacity(kv, None, 8, 5, 0)
    assert lay.fits(5, 0) and not ArenaLayout(lay.memory_budget - 1, 8, kv, None).fits(5, 0)
    st = LinearStateSpec.kda(1, 2, 8, 4, torch.float32)
    lay = ArenaLayout.for_capacity(None, st, 8, 0, 4)
    assert lay.fits(0, 4) and lay.num_pages == 0
    assert budget_for(None, st, 8, 0, 4, page_bytes=0, slot_bytes=st.slot_bytes) == lay.memory_budget


def test_for_capacity_refuses_a_count_for_a_side_without_a_spec():
    from unimem_compile.pool import geometry

    kv, state = geometry("kimi-linear-48b")
    with pytest.raises(GeometryError, match="n_slots=1 but the layout has no state spec"):
        ArenaLayout.for_capacity(kv, None, 64, 0, 1)
    with pytest.raises(GeometryError, match="n_pages=2 but the layout has no KV spec"):
        ArenaLayout.for_capacity(None, state, 64, 2, 1)
    with pytest.raises(GeometryError, match="n_slots=2 but the layout has no state spec"):
        UnifiedPool.for_capacity(kv, None, 64, 4, 2, "meta")
    assert ArenaLayout.for_capacity(kv, None, 64, 4, 0).num_pages >= 4  # the sides it has still size as asked
    assert ArenaLayout.for_capacity(None, state, 64, 0, 3).num_slots >= 3
