"""Sampling and the append step: draws follow softmax of the processed scores (chi-square), depend only on
a row's seed and token index, the bookkeeping matches a plain Python reference, and the step compiled with
fullgraph=True (no graph break, so no host sync) equals eager."""

import math

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from unimem_compile.runner import RowSettings, RowState, append_tokens, decode_step, draw_seeds, process_logits, sample


def chi2_sf_even(x: float, df: int) -> float:
    """P(chi2_df > x) for even df: exp(-x/2) * sum_{i < df/2} (x/2)^i / i! (closed form of the gamma tail)."""
    return math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(df // 2))


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def filled(settings, vocab, max_new=16, ids=None):
    state = RowState(len(settings), vocab, max_new, "cpu")
    state.set_rows(0, settings, ids if ids is not None else torch.zeros(len(settings), 1, dtype=torch.long))
    return state


V_SMALL = 8
DRAWS = 40_000
P_MIN = 1e-4  # the test fails if the sampler's counts are this unlikely under the target distribution


@pytest.mark.parametrize("stream", ["one_seed_over_token_indices", "many_seeds_at_token_zero"])
def test_draws_follow_softmax_of_the_processed_scores(gen, stream):
    logits = torch.randn(V_SMALL, generator=gen) * 1.5
    s = RowSettings(do_sample=True, temperature=0.8, top_k=5, max_new_tokens=16)
    want = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(5)])(None, logits[None].clone())[0]
    probs = want.softmax(-1).double()
    kept = torch.isfinite(want)
    if stream == "one_seed_over_token_indices":
        state = filled([RowSettings(**{**s.__dict__, "seed": 1234})] * DRAWS, V_SMALL)
        state.count.copy_(torch.arange(DRAWS, dtype=torch.int32))
    else:
        state = filled([RowSettings(**{**s.__dict__, "seed": x}) for x in draw_seeds(DRAWS, gen)], V_SMALL)
    rows = state.view(DRAWS)
    tokens = sample(process_logits(logits.expand(DRAWS, V_SMALL), rows), rows)
    counts = torch.bincount(tokens, minlength=V_SMALL).double()
    assert int(counts[~kept].sum()) == 0  # top-k's removed tokens are never drawn
    df = int(kept.sum()) - 1
    assert df == 4
    stat = chi2(counts[kept], probs[kept])
    assert chi2_sf_even(stat, df) > P_MIN, f"chi2 {stat:.1f} with {df} degrees of freedom"
    # the same counts against the unwarped softmax are rejected: the check has power
    wrong = logits.softmax(-1).double()[kept]
    assert chi2_sf_even(chi2(counts[kept], wrong / wrong.sum()), df) < 1e-12


def mixed_settings(seed0=0):
    return [
        RowSettings(do_sample=True, temperature=0.9, top_k=12, top_p=0.9, repetition_penalty=1.2,
                    min_new_tokens=2, max_new_tokens=9, eos_token_ids=(2, 3), pad_token_id=0, seed=seed0 + 11),
        RowSettings(do_sample=False, repetition_penalty=1.5, max_new_tokens=6, eos_token_ids=(2,), pad_token_id=2),
        RowSettings(do_sample=True, min_p=0.05, max_new_tokens=12, eos_token_ids=(4,), pad_token_id=1,
                    seed=seed0 + 12),
        RowSettings(do_sample=True, top_k=3, temperature=1.7, max_new_tokens=5, seed=seed0 + 13),
    ]


VOCAB = 40


def run_steps(settings, logits_per_step, ids, fn=decode_step, **kw):
    """``len(logits_per_step)`` steps; returns the state (rows in the order of ``settings``)."""
    state = filled(settings, VOCAB, ids=ids)
    rows = state.view(len(settings))
    for logits in logits_per_step:
        fn(logits, rows, **kw)
    return state


def step_logits(gen, rows, steps):
    # EOS-heavy logits so rows finish mid-run: ids 2..4 get +3
    bias = torch.zeros(VOCAB)
    bias[2:5] = 3.0
    return [torch.randn(rows, VOCAB, generator=gen) * 2 + bias for _ in range(steps)]


def test_same_seeds_same_tokens_and_other_seeds_other_tokens(gen):
    ids = torch.randint(5, VOCAB, (4, 6), generator=gen)
    logits = step_logits(gen, 4, 10)
    a = run_steps(mixed_settings(), logits, ids)
    b = run_steps(mixed_settings(), logits, ids)
    assert torch.equal(a.out, b.out) and torch.equal(a.count, b.count)
    c = run_steps(mixed_settings(seed0=1000), logits, ids)
    assert not torch.equal(a.out[[0, 2, 3]], c.out[[0, 2, 3]])
    assert torch.equal(a.out[1], c.out[1])  # the greedy row uses no seed


def test_a_rows_tokens_do_not_depend_on_the_other_rows(gen):
    settings = mixed_settings()
    ids = torch.randint(5, VOCAB, (4, 6), generator=gen)
    logits = step_logits(gen, 4, 10)
    alone = run_steps(settings, logits, ids)
    # the same rows reordered, between two other rows, in a bigger batch
    order = [3, None, 0, 2, None, 1]
    extra = [RowSettings(do_sample=True, max_new_tokens=16, seed=99), RowSettings(max_new_tokens=16)]
    big_settings = [settings[i] if i is not None else extra.pop() for i in order]
    big_ids = torch.stack([ids[i] if i is not None else ids[0].flip(0) for i in order])
    noise = step_logits(gen, 6, 10)
    big_logits = [torch.stack([lg[i] if i is not None else nz[j] for j, i in enumerate(order)])
                  for lg, nz in zip(logits, noise)]
    big = run_steps(big_settings, big_logits, big_ids)
    for j, i in enumerate(order):
        if i is not None:
            assert torch.equal(big.out[j], alone.out[i]) and big.count[j] == alone.count[i]
            assert bool(big.finished[j]) == bool(alone.finished[i])


def test_append_bookkeeping_matches_a_python_reference(gen):
    """Random token streams with EOS hits: count, finished, the output row (pad after the end), the
    presence set and the next input, step by step, against plain Python."""
    settings = [RowSettings(max_new_tokens=m, eos_token_ids=e, pad_token_id=p)
                for m, e, p in [(7, (2,), 0), (4, (), 9), (7, (3, 4), 3), (1, (2,), 1), (6, (2, 3), 2)]]
    n = len(settings)
    ids = torch.randint(5, VOCAB, (n, 3), generator=gen)
    state = filled(settings, VOCAB, max_new=8, ids=ids)
    rows = state.view(n)
    ref = [dict(tokens=[], finished=False, seen=set(ids[r].tolist())) for r in range(n)]
    for _ in range(9):
        drawn = torch.randint(0, 6, (n,), generator=gen)  # ids 2..4 are EOS for some rows
        got = append_tokens(drawn, rows)
        for r, (s, row) in enumerate(zip(settings, ref)):
            tok = int(drawn[r])
            if row["finished"]:
                tok = s.pad_token_id
            else:
                row["tokens"].append(tok)
                row["seen"].add(tok)
                row["finished"] = tok in s.eos_token_ids or len(row["tokens"]) >= s.max_new_tokens
            assert int(got[r]) == tok
            assert state.generated(r) == row["tokens"] and bool(state.finished[r]) == row["finished"]
            assert state.out[r].tolist() == row["tokens"] + [s.pad_token_id] * (8 - len(row["tokens"]))
            assert set(state.presence[r].nonzero().flatten().tolist()) == row["seen"]
    assert all(row["finished"] for row in ref)


def test_eos_waits_for_min_new_tokens(gen):
    logits = torch.randn(2, VOCAB, generator=gen)
    logits[:, 2] = 50.0  # EOS dominates: emitted as soon as it is allowed
    settings = [RowSettings(min_new_tokens=m, max_new_tokens=10, eos_token_ids=(2,)) for m in (0, 3)]
    state = filled(settings, VOCAB)
    for _ in range(5):
        decode_step(logits, state.view(2))
    assert state.generated(0) == [2]
    assert state.generated(1)[3] == 2 and 2 not in state.generated(1)[:3] and state.count[1] == 4


def test_greedy_graph_equals_the_sampling_graph_when_no_row_samples(gen):
    settings = [s for s in mixed_settings() if not s.do_sample] + [RowSettings(max_new_tokens=8, eos_token_ids=(3,))]
    ids = torch.randint(5, VOCAB, (len(settings), 4), generator=gen)
    logits = step_logits(gen, len(settings), 8)
    a = run_steps(settings, logits, ids, sampling=False)
    b = run_steps(settings, logits, ids, sampling=True)
    assert torch.equal(a.out, b.out) and torch.equal(a.finished, b.finished)


def assert_same_state(a, b):
    for name in ("out", "count", "finished", "presence", "last_token"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_step_equals_eager_without_graph_breaks_or_recompiles(gen, backend):
    """fullgraph=True fails on any graph break (a .item(), a data-dependent shape), so a compiled step has
    no host sync; the same graph serves every step (a recompile raises)."""
    torch._dynamo.reset()
    settings = mixed_settings()
    ids = torch.randint(5, VOCAB, (4, 6), generator=gen)
    logits = step_logits(gen, 4, 8)
    eager = run_steps(settings, logits, ids)
    step = torch.compile(decode_step, fullgraph=True, backend=backend)
    state = filled(settings, VOCAB, ids=ids)
    rows = state.view(4)
    step(logits[0], rows)
    with torch.compiler.set_stance("fail_on_recompile"):
        for lg in logits[1:]:
            step(lg, rows)
    assert_same_state(state, eager)
    assert bool(state.finished.any())  # the run covered finished rows
    fresh = filled(settings, VOCAB, ids=ids)
    scores = torch.compile(process_logits, fullgraph=True, backend="aot_eager")(logits[0], fresh.view(4))
    assert torch.equal(scores, process_logits(logits[0], fresh.view(4)))
