"""The counter-based generator: Philox4x32-10 against Random123's known answers and a plain-integer
reference, uniforms that depend only on (seed, token index, vocabulary id), seeds from torch's generator."""

import pytest
import torch

from unimem_compile.runner import draw_seeds
from unimem_compile.runner.rng import _unit, gumbel, philox4x32, uniforms

# Random123 kat_vectors, "philox4x32 10": counter[4], key[2] -> output[4]
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def philox_reference(counter, key, rounds=10):
    """Philox4x32 on Python ints (Salmon et al. 2011, Random123's key schedule)."""
    c, (k0, k1) = list(counter), key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k1, p0 & 0xFFFFFFFF]
    return c


def uniform_reference(seed, t, v):
    """The module docstring's definition of the uniform for (seed, token index t, vocabulary id v)."""
    s = seed & (2**64 - 1)
    w = philox_reference((v // 2, t, 0, 0), (s & 0xFFFFFFFF, s >> 32))
    hi, lo = (w[0], w[1]) if v % 2 == 0 else (w[2], w[3])
    return ((hi << 20 | lo >> 12) + 0.5) * 2.0**-52


def test_philox_matches_random123_known_answers():
    for counter, key, want in KNOWN_ANSWERS:
        assert philox_reference(counter, key) == list(want)
        got = philox4x32(tuple(torch.tensor([c]) for c in counter), tuple(torch.tensor([k]) for k in key))
        assert [int(w) for w in got] == list(want)


def test_uniforms_match_the_integer_definition():
    seeds = [0, 1, -1, 2**62 + 12345, -(2**63), 987654321]
    index = [0, 1, 7, 2**31 - 1, 3, 1000]
    vocab = 13  # odd: the last pair's second word is dropped
    got = uniforms(torch.tensor(seeds), torch.tensor(index, dtype=torch.int32), vocab)
    want = torch.tensor([[uniform_reference(s, t, v) for v in range(vocab)] for s, t in zip(seeds, index)],
                        dtype=torch.float64)
    assert got.dtype == torch.float64 and torch.equal(got, want)
    assert bool((got > 0).all() and (got < 1).all())


def test_uniforms_stay_inside_the_open_interval_at_the_extreme_words():
    top = torch.tensor([0xFFFFFFFF])
    assert float(_unit(top, top)) == 1 - 2.0**-53 and float(_unit(top * 0, top * 0)) == 2.0**-53
    assert torch.isfinite(-torch.log(-torch.log(_unit(top, top))))


def test_uniforms_of_a_row_ignore_the_other_rows(gen):
    seeds = torch.randint(-(2**63), 2**63 - 1, (9,), generator=gen)
    index = torch.randint(0, 10**6, (9,), generator=gen)
    batch = uniforms(seeds, index, 40)
    perm = torch.randperm(9, generator=gen)
    assert torch.equal(uniforms(seeds[perm], index[perm], 40), batch[perm])
    for r in (0, 4, 8):
        assert torch.equal(uniforms(seeds[r:r + 1], index[r:r + 1], 40)[0], batch[r])


def test_consecutive_tokens_and_seeds_draw_different_numbers():
    u = uniforms(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]), 64)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert u.unique().numel() == u.numel()


def test_gumbel_noise_has_the_gumbel_mean_and_variance():
    g = gumbel(torch.tensor([11, 12]), torch.tensor([3, 4]), 50_000)
    assert bool(torch.isfinite(g).all())
    # standard Gumbel: mean = Euler-Mascheroni 0.5772, variance pi^2 / 6 = 1.6449; 100k draws: se 0.004 / 0.01
    assert abs(float(g.mean()) - 0.5772) < 0.02
    assert abs(float(g.var()) - 1.6449) < 0.05


def test_seeds_follow_torch_manual_seed():
    torch.manual_seed(123)
    a = draw_seeds(4)
    torch.manual_seed(123)
    assert draw_seeds(4) == a and len(set(a)) == 4
    assert draw_seeds(3, torch.Generator().manual_seed(5)) == draw_seeds(3, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="-1"):
        draw_seeds(-1)
