"""DAPO's overlong penalty and dynamic sampling (batch refill), and the rollout-correction modes,
against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms import (
    AlgorithmConfig,
    GroupRefill,
    groups_with_signal,
    masked_is,
    overlong_penalty,
    rollout_correction,
    sequence_tis_weights,
)


def close(actual, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=0,
    )


# ---------------------------------------------------------------- overlong penalty


def test_overlong_penalty_hand_computed():
    # max 20, buffer 4 -> expected 16; exceed = len - 16; penalty = min(-exceed / 4 * factor, 0)
    lengths = torch.tensor([10, 16, 17, 18, 20])
    close(overlong_penalty(lengths, 20, 4, 1.0), [0.0, 0.0, -0.25, -0.5, -1.0])
    close(overlong_penalty(lengths, 20, 4, 0.5), [0.0, 0.0, -0.125, -0.25, -0.5])
    # buffer = max: every token is in the zone (verl allows it)
    close(overlong_penalty(torch.tensor([0, 4, 8]), 8, 8, 1.0), [0.0, -0.5, -1.0])
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


# ---------------------------------------------------------------- rollout correction
# rho = pi_trainer_old / pi_engine per token. Row 0: [1.5, 4.0, 0.25] (product 1.5, geometric mean
# 1.5^(1/3) = 1.1447142); row 1: [0.8, 1.25] (geometric mean 1). Padding engine log-probs are garbage.
RHO = [[1.5, 4.0, 0.25, 1.0], [0.8, 1.25, 1.0, 1.0]]
RC_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
OLD = torch.zeros(2, 4)
ENGINE = torch.tensor([[-math.log(r) for r in row] for row in RHO])
ENGINE[0, 3] = ENGINE[1, 2] = -1e9
GEO0 = 1.5 ** (1 / 3)


def _rc(mode: str, **kw):
    return rollout_correction(AlgorithmConfig(rollout_correction=mode, **kw), OLD, ENGINE, RC_MASK)


def test_rollout_correction_none():
    assert _rc("none") == (None, None, {})


def test_token_tis():
    w, keep, m = _rc("tis", rollout_correction_cap=2.0)
    assert keep is None
    close(w, [[1.5, 2.0, 0.25, 0], [0.8, 1.25, 0, 0]])
    close(m["rollout_corr/weight_mean"], 5.8 / 5)
    close(m["rollout_corr/weight_max"], 2.0)
    close(m["rollout_corr/masked_frac"], 0.0)
    close(m["rollout_corr/truncated_frac"], 1 / 5)


def test_sequence_tis_geometric_mean():
    w, keep, m = _rc("seq_tis", rollout_correction_cap=2.0)
    assert keep is None
    close(w, [[GEO0, GEO0, GEO0, 0], [1.0, 1.0, 0, 0]])
    close(m["rollout_corr/weight_mean"], (3 * GEO0 + 2) / 5)
    close(m["rollout_corr/truncated_frac"], 0.0)
    # cap 1.1 truncates row 0 (3 of 5 tokens)
    w, _, m = _rc("seq_tis", rollout_correction_cap=1.1)
    close(w, [[1.1, 1.1, 1.1, 0], [1.0, 1.0, 0, 0]])
    close(m["rollout_corr/truncated_frac"], 3 / 5)
    assert not sequence_tis_weights(OLD.clone().requires_grad_(), ENGINE, RC_MASK, 2.0).requires_grad


def test_token_masked_is():
    w, keep, m = _rc("token_mis", rollout_correction_lower=0.5, rollout_correction_upper=2.0)
    # 4.0 > 2 and 0.25 < 0.5 are dropped
    close(keep, [[1, 0, 0, 0], [1, 1, 0, 0]])
    close(w, [[1.5, 0, 0, 0], [0.8, 1.25, 0, 0]])
    close(m["rollout_corr/masked_frac"], 2 / 5)
    close(m["rollout_corr/weight_mean"], 3.55 / 3)
    close(m["rollout_corr/weight_max"], 1.5)
    assert "rollout_corr/truncated_frac" not in m


def test_sequence_masked_is():
    w, keep, m = _rc("seq_mis", rollout_correction_lower=0.9, rollout_correction_upper=1.1)
    # row 0's geometric mean 1.1447 > 1.1: the whole sequence is dropped; row 1 (1.0) stays
    close(keep, [[0, 0, 0, 0], [1, 1, 0, 0]])
    close(w, [[0, 0, 0, 0], [1.0, 1.0, 0, 0]])
    close(m["rollout_corr/masked_frac"], 3 / 5)
    close(m["rollout_corr/weight_mean"], 1.0)
    with pytest.raises(ValueError, match="level"):
        masked_is(OLD, ENGINE, RC_MASK, 0.5, 2.0, "batch")
