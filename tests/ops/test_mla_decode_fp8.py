"""mla_decode's split kernel on scaled fp8 rows (Triton interpreter, fp32 queries, both e4m3 formats: e4m3fn
through the fp8 type's conversion, e4m3fnuz through the integer decoder), against two references on the
same arena:

* float64 attention over the rows' exact values ``fp32(code) * scale`` (what the kernel computes: it
  applies each 128-value tile's scale after the dot, so no value is rounded): fp32 sums in another order,
  held to ``2e-5 x max |value|`` per output (an fp32 dot of a few hundred terms of random sign is good to
  about ``1e-6`` relative; the margin covers the online softmax's rescalings);
* :func:`mla_decode_reference`, which reads the bf16 values ``mla_gather`` returns (``bf16(code * scale)``):
  its values differ from the exact ones by at most ``u = 2^-8`` relative (bf16's unit roundoff), which
  moves each score by at most ``d = sm_scale x u x sum |q_nope| |k_nope|`` and so each softmax weight by a
  factor within ``exp(+-2d)``; an output then differs by at most ``max |v| (u + exp(2d) - 1)``, computed
  per (row, head) from the data, plus the fp32 allowance above.
"""

import importlib

import pytest
import torch

from unimem_compile.ops import fp8
from unimem_compile.pool import ArenaLayout, MLASpec, UnifiedPool

md = importlib.import_module("unimem_compile.ops.mla_decode")
mw = importlib.import_module("unimem_compile.ops.mla_write")

FORMATS = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
L, LAYER, H, SCALE = 3, 1, 4, 0.11
U_BF16 = 2.0 ** -8


class Fp8Rows:
    """A poisoned pool (unwritten bytes NaN) of fp8 rows: ragged rows of random latents at several
    magnitudes (scales spanning binades), written by the quantising write; the exact values kept aside."""

    def __init__(self, fmt, r, dr, page_size, lens, gen):
        self.geometry = (LAYER, L, page_size, r, dr, fmt)
        self.r = r
        n_pages = sum(-(-n // page_size) for n in lens) + 1
        spec = MLASpec(L, r, dr, fmt)
        self.pool = UnifiedPool(ArenaLayout.for_capacity(spec, None, page_size, n_pages + 2, 0), poison=True)
        self.fmt = spec.row_format
        width = max(1, max(-(-n // page_size) for n in lens))
        self.page_table = torch.full((len(lens), width), -1, dtype=torch.int32)
        self.kv_len = torch.tensor(lens, dtype=torch.int32)
        self.exact = []
        for b, n in enumerate(lens):
            pages = self.pool.alloc_pages(-(-n // page_size)) if n else []
            self.page_table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            i = torch.arange(n)
            loc = torch.tensor(pages, dtype=torch.int64)[i // page_size] * page_size + i % page_size if n else \
                torch.zeros(0, dtype=torch.int64)
            for layer in range(L):
                mag = torch.exp2(torch.randint(-4, 4, (n, 1), generator=gen).float())
                nope = torch.randn(n, r, generator=gen) * mag
                rope = torch.randn(n, dr, generator=gen)
                mw.mla_kv_write_reference(self.pool.arena, self.pool.v2p, loc, nope, rope, layer, L, page_size, r,
                                          dr, fmt)
                if layer == LAYER:
                    self.exact.append(self._exact(self.pool.read_kv(LAYER, loc)))

    def _exact(self, rows):
        """float64 values of fp8 rows: ``code * scale`` unrounded, the rope as stored."""
        f = self.fmt
        codes = rows[:, : self.r].contiguous().view(f.dtype).double()
        scale = rows[:, f.scale_offset: f.rope_offset].contiguous().view(torch.float32).double()
        latent = codes * scale.repeat_interleave(128, dim=1)[:, : self.r]
        rope = rows[:, f.rope_offset: f.rope_offset + 2 * f.qk_rope_head_dim].contiguous().view(torch.bfloat16)
        return torch.cat([latent, rope.double()], 1)

    def args(self, q_nope, q_rope):
        return (q_nope, q_rope, self.pool.arena, self.pool.v2p, self.page_table, self.kv_len, SCALE, *self.geometry)


def _attention(q_nope, q_rope, rows, r):
    """float64 softmax attention of one row's heads over ``rows [n, R + Dr]`` (zeros when n == 0), with the
    bound of the module docstring on the difference a bf16 rounding of the latents makes."""
    if rows.shape[0] == 0:
        return torch.zeros(q_nope.shape, dtype=torch.float64), torch.zeros(q_nope.shape[0], dtype=torch.float64)
    q = torch.cat([q_nope, q_rope], -1).double()
    out = torch.softmax(q @ rows.T * SCALE, -1) @ rows[:, :r]
    d = SCALE * U_BF16 * (q_nope.double().abs() @ rows[:, :r].abs().T).amax(-1)  # [H]
    vmax = rows[:, :r].abs().max()
    return out, vmax * (U_BF16 + torch.expm1(2 * d))


CASES = [  # (R, Dr, page size, lengths): tile count and page layouts of the kernel
    (256, 32, 16, [37, 0, 70, 1]),  # two full scale tiles, per-token page lookups (32-token tiles)
    (192, 64, 64, [130, 5]),  # a half-filled second tile, one page per 64-token tile
    (64, 16, 1, [9, 23]),  # one 64-column tile, a page per token
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("r, dr, page_size, lens", CASES)
def test_kernel_on_fp8_rows_matches_exact_attention_and_the_reference_within_the_bf16_bound(fmt, r, dr, page_size,
                                                                                          lens, gen):
    rows = Fp8Rows(fmt, r, dr, page_size, lens, gen)
    q_nope, q_rope = torch.randn(len(lens), H, r, generator=gen), torch.randn(len(lens), H, dr, generator=gen)
    ref = md.mla_decode_reference(*rows.args(q_nope, q_rope)).double()
    for splits in (1, 3):
        got = md.mla_decode_triton(*rows.args(q_nope, q_rope), num_splits=splits).double()
        assert got.shape == (len(lens), H, r) and not bool(got.isnan().any())
        for b, exact in enumerate(rows.exact):
            want, bound = _attention(q_nope[b], q_rope[b], exact, r)
            slack = 2e-5 * float(exact[:, :r].abs().max()) if exact.shape[0] else 0.0
            assert float((got[b] - want).abs().max()) <= slack, (b, splits)
            gap = (got[b] - ref[b]).abs().amax(-1)  # [H]
            assert bool((gap <= bound * 1.001 + 2 * slack).all()), (b, splits, gap, bound)
    # the bf16 rounding the reference makes is visible: the kernel does not read the rounded values
    assert float((got - ref).abs().max()) > 0


def test_the_kernel_reads_the_format_that_wrote_the_rows(gen):
    # e4m3fnuz bytes read as e4m3fn double every latent (exponent bias 8 vs 7) and turn the tile maxima's
    # code 0x7F (240) into NaN: the kernel must decode each format with its own rule
    r, dr, ps, lens = 128, 16, 16, [20, 33]
    q_nope, q_rope = torch.randn(2, H, r, generator=gen), torch.randn(2, H, dr, generator=gen)
    rows = Fp8Rows(torch.float8_e4m3fnuz, r, dr, ps, lens, gen)
    got = md.mla_decode_triton(*rows.args(q_nope, q_rope)).double()
    misread = list(rows.args(q_nope, q_rope))
    misread[-1] = torch.float8_e4m3fn
    wrong = md.mla_decode_triton(*misread).double()
    for b, exact in enumerate(rows.exact):
        want, _ = _attention(q_nope[b], q_rope[b], exact, r)
        assert float((got[b] - want).abs().max()) <= 2e-5 * float(exact[:, :r].abs().max())
    assert bool(wrong.isnan().any()) or float((wrong - got).abs().max()) > 0.1


def test_fp8_kernel_choices():
    # the fp8 type's conversion where Triton has one for the format (e4m3fn on sm_89+ and the interpreter),
    # the integer decoder elsewhere (e4m3fnuz everywhere: sm_90 Triton has no e4m3fnuz conversion)
    cpu = torch.device("cpu")
    assert md.fp8_hw_conversion(cpu, torch.float8_e4m3fn) and not md.fp8_hw_conversion(cpu, torch.float8_e4m3fnuz)


class _Launched(Exception):
    """Raised by the stand-in for the Hopper fp8 launcher: the CPU can check what it was handed, not run it."""


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_rows_take_the_hopper_kernel_by_name_and_by_auto_where_it_applies(fmt, gen, monkeypatch):
    from unimem_compile.ops import mla_decode_hopper as hop

    rows = Fp8Rows(fmt, 512, 64, 64, [70, 3], gen)
    q_nope, q_rope = torch.randn(2, H, 512, generator=gen), torch.randn(2, H, 64, generator=gen)
    args = rows.args(q_nope, q_rope)
    with pytest.raises(ValueError, match=r"wgmma kernel needs an sm_90 GPU, bf16/fp16/e4m3fn/e4m3fnuz KV.*got device "
                                         rf"cpu, {fmt}, page_size 64, kv_lora_rank 512, qk_rope_head_dim 64"):
        md.mla_decode_triton(*args, kernel="wgmma")
    want = md.mla_decode_triton(*args, kernel="portable")
    torch.testing.assert_close(md.mla_decode_triton(*args), want, atol=0, rtol=0)  # auto off sm_90: portable
    calls = []

    def launched(q_n, q_r, kv_rows, row_format, *rest, **kw):
        calls.append((kv_rows, row_format, rest, kw))
        raise _Launched

    monkeypatch.setattr(md, "wgmma_supported", lambda *a: True)
    monkeypatch.setattr(md, "mla_decode_stage1_wgmma_fp8", launched)
    assert md.FP8_AUTO_WGMMA  # 2x the portable fp8 kernel on the H200 (docs/ops.md)
    with pytest.raises(_Launched):
        md.mla_decode_triton(*args, kernel="wgmma", num_splits=3)
    kv_rows, row_format, rest, kw = calls[0]
    n_rows = rows.pool.arena.numel() // 656
    assert kv_rows.dtype == torch.uint8 and tuple(kv_rows.shape) == (n_rows, 656)
    assert kv_rows.data_ptr() == rows.pool.arena.data_ptr() and row_format == rows.fmt
    # qk_scale (base 2), max_tokens, layer_rows, page_size, layer_num, splits, block_h
    assert rest[6:] == (pytest.approx(SCALE * 1.4426950408889634), 2 * 64, LAYER * 64, 64, L, 3, 16)
    assert kw == {"hw_fp8": fmt == torch.float8_e4m3fn, "stages": hop.WGMMA_STAGES, "f16_values": False}
    assert not hop.FP8_F16_VALUES  # the f16 chain: off until a GPU run times it
    with pytest.raises(_Launched):  # auto, where the kernel applies
        md.mla_decode_triton(*args)
    assert len(calls) == 2 and calls[1][3] == kw
    with pytest.raises(_Launched):
        md.mla_decode_triton(*args, wgmma_fp8_f16=True)
    assert calls[2][3] == dict(kw, f16_values=True)
    with pytest.raises(ValueError, match=r"wgmma_fp8_f16 must be True or False, got 1$"):
        md.mla_decode_triton(*args, wgmma_fp8_f16=1)
    monkeypatch.setattr(md, "FP8_AUTO_WGMMA", False)  # the switch back: auto on the portable fp8 kernel
    torch.testing.assert_close(md.mla_decode_triton(*args), want, atol=0, rtol=0)
    torch.testing.assert_close(md.mla_decode_triton(*args, kernel="portable"), want, atol=0, rtol=0)
    assert len(calls) == 3


def test_the_hopper_fp8_kernel_refuses_a_ring_depth_other_than_two_and_a_chain_that_is_not_a_bool():
    from unimem_compile.ops import mla_decode_hopper as hop

    for stages in (1, 3):  # checked before anything touches the (here absent) GPU
        with pytest.raises(ValueError, match=rf"fp8 kernel needs stages == 2 .*got {stages}$"):
            hop.mla_decode_stage1_wgmma_fp8(*[None] * 17, hw_fp8=True, stages=stages)
    with pytest.raises(ValueError, match=r"f16_values must be True or False, got 'yes'$"):
        hop.mla_decode_stage1_wgmma_fp8(*[None] * 17, hw_fp8=True, f16_values="yes")


def test_an_fp8_kernel_gluon_cannot_compile_falls_back_without_turning_off_the_bf16_one(gen, monkeypatch):
    import triton.compiler.errors

    from unimem_compile.ops import mla_decode_hopper as hop

    rows = Fp8Rows(torch.float8_e4m3fn, 512, 64, 64, [65], gen)
    args = rows.args(torch.randn(1, H, 512, generator=gen), torch.randn(1, H, 64, generator=gen))
    want = md.mla_decode_triton(*args, kernel="portable")

    def broken(*a, **k):
        raise triton.compiler.errors.CompilationError(None, None, "no such layout")

    monkeypatch.setattr(hop, "WGMMA_DISABLED", None)
    monkeypatch.setattr(hop, "WGMMA_FP8_DISABLED", None)
    monkeypatch.setattr(md, "FP8_AUTO_WGMMA", True)
    monkeypatch.setattr(md, "wgmma_supported", lambda *a: hop.WGMMA_FP8_DISABLED is None)
    monkeypatch.setattr(md, "mla_decode_stage1_wgmma_fp8", broken)
    with pytest.warns(RuntimeWarning, match="Hopper .Gluon. fp8 kernel does not compile .*no such layout"):
        got = md.mla_decode_triton(*args)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert hop.WGMMA_FP8_DISABLED is not None and hop.WGMMA_DISABLED is None


def test_fp8_row_descriptors_are_three_views_of_the_656_byte_rows_and_refuse_what_tma_cannot_read():
    from unimem_compile.ops import mla_decode_hopper as hop

    if hop.gluon is None:
        pytest.skip("this Triton has no Gluon")
    fmt = MLASpec(L, 512, 64, torch.float8_e4m3fnuz).row_format
    rows = torch.zeros(300, 656, dtype=torch.uint8)
    codes, rope, scales = hop.fp8_row_descriptors(rows, fmt)
    for d, width, box, swizzle in ((codes, 656, [64, 64], 64), (rope, 328, [64, 64], 128), (scales, 164, [64, 4], 0)):
        assert d.base.data_ptr() == rows.data_ptr()
        assert list(d.shape) == [300, width] and list(d.strides) == [width, 1] and list(d.block_shape) == box
        assert d.layout.swizzle_byte_width == swizzle
    assert (codes.base.dtype, rope.base.dtype, scales.base.dtype) == (torch.uint8, torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match=r"rows must be contiguous uint8 \[n_rows, 656\].*got torch.uint8 \(300, 640\)"):
        hop.fp8_row_descriptors(torch.zeros(300, 640, dtype=torch.uint8), fmt)
    shifted = torch.zeros(300 * 656 + 16, dtype=torch.uint8)[1: 1 + 300 * 656].view(300, 656)
    with pytest.raises(ValueError, match=r"16-byte aligned address; got .* at 0x[0-9a-f]*[1-9a-f]$"):
        hop.fp8_row_descriptors(shifted, fmt)
    with pytest.raises(ValueError, match=r"kv_lora_rank 512 and qk_rope_head_dim 64; got .*kv_lora_rank=256"):
        hop.fp8_row_descriptors(rows, MLASpec(L, 256, 64, torch.float8_e4m3fn).row_format)
