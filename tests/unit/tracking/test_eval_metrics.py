"""pass@k (the unbiased estimator of Chen et al. 2021) and the evaluation's figures."""

from __future__ import annotations

import itertools

import pytest

from hybridrl.tracking.eval_metrics import eval_figures, k_values, pass_at_k


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of all k-subsets of n samples (the first c correct) holding at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n, c, k", [(4, 1, 2), (8, 3, 4), (5, 0, 3), (5, 5, 1), (6, 2, 1), (7, 6, 2), (3, 1, 3)])
def test_pass_at_k_counts_subsets(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_1_is_the_share_correct():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_k_values():
    assert k_values(1) == [1]
    assert k_values(8) == [1, 2, 4, 8]
    assert k_values(6) == [1, 2, 4, 6]


def test_figures_per_prompt_groups():
    # Two prompts x 2 samples: prompt 0 has one right answer, prompt 1 none.
    figures = eval_figures(
        2,
        scores=[1.0, 0.5, 0.0, 0.5],
        extras={"correct": [1.0, 0.0, 0.0, 0.0]},
        correct=[True, False, False, False],
        lengths=[4, 6, 8, 2],
        finish_reasons=["stop", "stop", "length", "stop"],
    )
    assert figures["prompts"] == 2 and figures["samples"] == 4
    assert figures["pass@1"] == pytest.approx(0.25)  # (1/2 + 0) / 2
    assert figures["pass@2"] == pytest.approx(0.5)  # prompt 0 solved by some answer, prompt 1 not
    assert figures["reward/mean"] == pytest.approx(0.5) and figures["reward/correct"] == pytest.approx(0.25)
    assert figures["response/length_mean"] == 5 and figures["response/length_max"] == 8
    assert figures["response/clip_frac"] == pytest.approx(0.25)
