"""engine.scheduler.plan_prefill: the step's prefill forwards, exact on hand-worked cases and, over random
progress and budgets, within the budget, in order, each request once, packs only of whole first prefills."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unimem_compile.engine.scheduler import PrefillForward, plan_prefill


def test_hand_worked_plans():
    # a whole prompt leads a pack while rows x the longest fits: 12 x 3 = 36 <= 40, a fourth (x 4 = 48) does not
    assert plan_prefill([(0, 5), (0, 12), (0, 7), (0, 9)], 40, 8) == [
        PrefillForward((0, 1, 2), 12), PrefillForward((3,), 4, 0)]
    # a request mid-prefill goes on alone and ends the pack before it; the budget cuts the last chunk
    assert plan_prefill([(0, 6), (3, 20), (0, 4)], 16, 8) == [
        PrefillForward((0,), 6, 0), PrefillForward((1,), 10, 3)]
    # max_rows 1: one request per forward; a prompt longer than the budget is chunked
    assert plan_prefill([(0, 5), (0, 5), (0, 50)], 32, 1) == [
        PrefillForward((0,), 5, 0), PrefillForward((1,), 5, 0), PrefillForward((2,), 22, 0)]
    assert plan_prefill([(0, 20), (0, 20), (0, 20)], 64, 2) == [PrefillForward((0, 1), 20), PrefillForward((2,), 20, 0)]
    assert plan_prefill([], 8) == []
    assert PrefillForward((0, 1), 3).packed and not PrefillForward((0,), 3).packed


@pytest.mark.parametrize("progress, budget, rows, message", [
    ([(0, 4)], 0, 1, "budget and max_rows must be >= 1, got 0 and 1"),
    ([(0, 4)], 8, 0, "budget and max_rows must be >= 1, got 8 and 0"),
    ([(0, 4), (4, 4)], 8, 1, r"request 1 has stored 4 of 4 prefill tokens"),
    ([(-1, 4)], 8, 1, r"request 0 has stored -1 of 4"),
])
def test_bad_plans_are_refused_with_the_numbers(progress, budget, rows, message):
    with pytest.raises(ValueError, match=message):
        plan_prefill(progress, budget, rows)


@st.composite
def _progress(draw):
    n = draw(st.integers(0, 12))
    out = []
    for _ in range(n):
        total = draw(st.integers(1, 300))
        out.append((draw(st.sampled_from([0, 0, draw(st.integers(0, total - 1))])), total))
    return out


@settings(max_examples=300, deadline=None)
@given(_progress(), st.integers(1, 512), st.integers(1, 8))
def test_a_plan_keeps_the_budget_the_order_and_the_pack_rules(progress, budget, max_rows):
    plan = plan_prefill(progress, budget, max_rows)
    reached = [i for f in plan for i in f.requests]
    assert reached == list(range(len(reached)))  # oldest first, each once, nobody overtaken
    left = budget
    for f in plan:
        assert 1 <= len(f.requests) <= max_rows and f.tokens >= 1
        if f.packed:  # whole first prefills, the width the longest, the pads counted
            assert all(progress[i][0] == 0 for i in f.requests) and f.start == 0
            assert f.tokens == max(progress[i][1] for i in f.requests)
            assert f.tokens * len(f.requests) <= left
            left -= f.tokens * len(f.requests)
        else:
            stored, total = progress[f.requests[0]]
            assert f.start == stored and f.tokens == min(left, total - stored)
            left -= f.tokens
        assert left >= 0
    if len(reached) < len(progress):  # the budget, not the requests, ended the step
        assert left == 0
