"""hybridrl.algorithms.dapo: DAPO's overlong penalty and dynamic sampling (groups without signal dropped, the batch
refilled from later rounds), against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from hybridrl.algorithms import GroupRefill, groups_with_signal, overlong_penalty
from tests.unit.algorithms.reference import assert_close

# ---------------------------------------------------------------- overlong penalty


def test_overlong_penalty_hand_computed():
    # max 20, buffer 4 -> expected 16; exceed = len - 16; penalty = min(-exceed / 4 * factor, 0)
    lengths = torch.tensor([10, 16, 17, 18, 20])
    assert_close(overlong_penalty(lengths, 20, 4, 1.0), [0.0, 0.0, -0.25, -0.5, -1.0])
    assert_close(overlong_penalty(lengths, 20, 4, 0.5), [0.0, 0.0, -0.125, -0.25, -0.5])
    # buffer = max: every token is in the zone (verl allows it)
    assert_close(overlong_penalty(torch.tensor([0, 4, 8]), 8, 8, 1.0), [0.0, -0.5, -1.0])
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 20, 21, 1.0)


# ---------------------------------------------------------------- dynamic sampling


def test_groups_with_signal():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0])
    assert groups_with_signal(scores, 2).tolist() == [False, True, False, False]
    # 0.1 is inexact in float32 but equal values are equal: no signal
    assert groups_with_signal(torch.full((3,), 0.1), 3).tolist() == [False]
    with pytest.raises(ValueError, match="group_size"):
        groups_with_signal(scores, 3)


def _round(signal: list[bool]) -> torch.Tensor:
    """Scores [4 groups * 2] with a signal pattern: [0, 1] carries signal, [1, 1] does not."""
    return torch.tensor([v for s in signal for v in ((0.0, 1.0) if s else (1.0, 1.0))])


def test_refill_two_then_three_of_four_gives_exactly_four_in_order():
    refill = GroupRefill(target_groups=4, group_size=2, max_resample_rounds=5)
    assert refill.needs_more
    assert refill.add(_round([True, False, True, False])) == 2  # groups 0, 2 of round 0
    assert refill.needs_more
    assert refill.add(_round([True, True, False, True])) == 3  # groups 0, 1, 3 of round 1
    assert not refill.needs_more
    plan = refill.finish()
    # round 0: groups 0 and 2 -> rows [0, 1, 4, 5]; round 1: groups 0 and 1 -> rows [0, 1, 2, 3];
    # round 1's group 3 is overflow, trimmed
    assert [r.tolist() for r in plan.rows] == [[0, 1, 4, 5], [0, 1, 2, 3]]
    assert sum(len(r) for r in plan.rows) == 4 * 2
    assert (plan.rounds, plan.kept_groups, plan.filtered_groups, plan.filled_groups, plan.trimmed_groups) == (
        2,
        4,
        3,
        0,
        1,
    )
    assert plan.metrics() == {
        "batch/resample_rounds": 1.0,
        "batch/filtered_groups": 3.0,
        "batch/filled_groups": 0.0,
        "batch/trimmed_groups": 1.0,
    }


def test_refill_bound_reached_fills_with_dropped_groups_earliest_first():
    refill = GroupRefill(target_groups=4, group_size=2, max_resample_rounds=1)
    refill.add(_round([False, False, False, True]))
    assert refill.needs_more
    refill.add(_round([False, False, False, False]))
    assert not refill.needs_more  # 1 + 1 rounds spent
    plan = refill.finish()
    # kept: round 0 group 3; filled with round 0 groups 0, 1, 2 (earliest first): all of round 0
    assert [r.tolist() for r in plan.rows] == [list(range(8)), []]
    assert (plan.kept_groups, plan.filled_groups, plan.filtered_groups) == (1, 3, 7)


def test_refill_first_round_full_and_errors():
    refill = GroupRefill(target_groups=2, group_size=2, max_resample_rounds=0)
    refill.add(_round([True, True]))
    assert not refill.needs_more
    assert [r.tolist() for r in refill.finish().rows] == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="before any round"):
        GroupRefill(target_groups=2, group_size=2, max_resample_rounds=0).finish()
    with pytest.raises(ValueError, match="group_size >= 2"):
        GroupRefill(target_groups=2, group_size=1, max_resample_rounds=0)
