"""Counter-based random numbers for sampling: Philox4x32-10 written with int64 tensor ops.

A row's random draw for its token index ``t`` and vocabulary id ``v`` is a pure function of
``(seed, t, v)``. It never depends on which other rows share the batch, on the row's position in it, or
on how many CUDA graphs were replayed before, and it needs no generator state on the device: a captured
graph reads the row's seed and its generated-token count and nothing else.

The generator is Philox4x32-10 (Salmon, Moraes, Dror & Shaw, "Parallel Random Numbers: As Easy as 1, 2,
3", SC 2011; the constants and key schedule of the Random123 library, whose known-answer vectors
tests/runner/test_rng.py checks). With the row's 64-bit seed as the key ``(seed_lo, seed_hi)`` and the
counter ``(v // 2, t, 0, 0)``, one block of four 32-bit words gives two uniforms: words 0-1 for the even id
``v``, words 2-3 for the odd one. Each uniform keeps 52 random bits: ``u = ((w_hi << 20 | w_lo >> 12) + 0.5)
* 2**-52``, exact in float64 and strictly inside ``(0, 1)`` (with 53 bits, ``2**53 - 0.5`` would round up to
``u = 1`` and an infinite Gumbel variable).

Why 32-bit words in int64 tensors: torch has no unsigned 64-bit arithmetic (``uint64`` lacks add and
shifts), and a wrapping int64 multiply is signed overflow, undefined in the C++ Inductor generates on a
CPU: GCC used it to drop a loop bound (a splitmix64 version of this module segfaulted when compiled). Here
every intermediate stays in ``[0, 2**49)``: the 32x32-bit products of Philox's ``mulhilo`` are assembled
from two 32x16-bit products, so the same bits come out of eager, Inductor-CPU and Triton code.
"""

from __future__ import annotations

import torch

__all__ = ["PHILOX_ROUNDS", "philox4x32", "uniforms", "gumbel", "draw_seeds"]

PHILOX_ROUNDS = 10
"""Rounds of Philox4x32 (Random123's default; 7 is its smallest Crush-resistant count)."""

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # key schedule (Weyl sequence) increments
_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * m`` for ``a`` in ``[0, 2**32)`` and a 32-bit constant ``m``,
    without an intermediate above ``2**49`` (so nothing overflows int64)."""
    p_lo = a * (m & _MASK16)  # < 2**48
    mid = a * (m >> 16) + (p_lo >> 16)  # a * m == mid * 2**16 + (p_lo & 0xFFFF)
    return mid >> 16, ((mid & _MASK16) << 16) | (p_lo & _MASK16)


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor],
               rounds: int = PHILOX_ROUNDS) -> tuple[torch.Tensor, ...]:
    """The Philox4x32 block function on tensors of 32-bit words.

    Args:
        counter: four int64 tensors of words in ``[0, 2**32)`` (broadcastable together).
        key: two int64 tensors of words in ``[0, 2**32)`` (broadcastable with the counter).
        rounds: Philox rounds.

    Returns:
        four int64 tensors of words in ``[0, 2**32)``, the broadcast shape of the inputs (new tensors).
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:  # Random123 bumps the key before every round but the first
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _unit(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """52 bits of two 32-bit words as a float64 in ``(0, 1)``: ``[2**-53, 1 - 2**-53]``."""
    bits = (hi << 20) | (lo >> 12)  # < 2**52, so adding 0.5 is exact
    return (bits.to(torch.float64) + 0.5) * (2.0**-52)


def uniforms(seed: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform draws in ``(0, 1)`` for every (row, vocabulary id) at each row's token index.

    Args:
        seed: int64 ``[n]``: each row's seed (any 64-bit pattern; the Philox key).
        index: integer ``[n]`` (int32 or int64) in ``[0, 2**32)``: each row's token index.
        vocab: the vocabulary size ``V`` (at most ``2**33``).

    Returns:
        float64 ``[n, V]``: ``out[r, v]`` is a function of ``(seed[r], index[r], v)`` only (module docstring).
    """
    n = seed.shape[0]
    key = ((seed & _MASK32)[:, None], ((seed >> 32) & _MASK32)[:, None])
    pairs = torch.arange((vocab + 1) // 2, device=seed.device, dtype=torch.int64)[None, :]
    zero = torch.zeros((), device=seed.device, dtype=torch.int64)
    w0, w1, w2, w3 = philox4x32((pairs, index.to(torch.int64)[:, None], zero, zero), key)
    both = torch.stack((_unit(w0, w1), _unit(w2, w3)), dim=-1)  # [n, V/2, 2]: ids 2j and 2j + 1
    return both.reshape(n, -1)[:, :vocab]


def gumbel(seed: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` on :func:`uniforms` (same arguments), float64 ``[n, V]``.

    With it, ``argmax(logits + noise)`` is a draw from ``softmax(logits)`` (the Gumbel-max trick: Gumbel
    1954; Maddison, Tarlow & Minka, "A* Sampling", NeurIPS 2014); entries at ``-inf`` are never drawn.
    The 52-bit uniforms bound the noise to ``[-3.61, 36.74]``, which changes a draw's probability only
    through events of probability below ``1e-15`` per (row, vocabulary id).
    """
    return -torch.log(-torch.log(uniforms(seed, index, vocab)))


def draw_seeds(n: int, generator: torch.Generator | None = None) -> list[int]:
    """``n`` row seeds drawn from a torch CPU generator (torch's default one unless ``generator`` is given).

    Drawing the seeds of one generate() call here, once, when the call starts makes ``torch.manual_seed(s)``
    reproduce the call's tokens exactly, as it does for stock transformers (which draws with
    ``torch.multinomial`` from the device's default generator instead: the two draw different tokens from
    the same distributions). It advances the CPU default generator by one ``randint`` of ``n`` values.

    Returns:
        ``n`` Python ints in ``[-2**63, 2**63 - 1)``.

    Raises:
        ValueError: ``n`` is negative.
    """
    if n < 0:
        raise ValueError(f"cannot draw a negative number of seeds ({n})")
    return torch.randint(-(1 << 63), (1 << 63) - 1, (n,), dtype=torch.int64, generator=generator).tolist()
