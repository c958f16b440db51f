"""hybridrl.algorithms.correction: the engine–trainer mismatch metrics and the rollout corrections (token and
sequence TIS, token and sequence masked IS), against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms import (
    AlgorithmConfig,
    masked_is,
    mismatch_metrics,
    rollout_correction,
    sequence_tis_weights,
    truncated_is_weights,
)
from tests.unit.algorithms.reference import assert_close


def test_truncated_is_weights():
    old = torch.zeros(4, requires_grad=True)
    engine = torch.tensor([0.0, -math.log(1.5), -math.log(4.0), -1e9])
    mask = torch.tensor([1, 1, 1, 0])
    w = truncated_is_weights(old, engine, mask, cap=2.0)
    assert_close(w, [1.0, 1.5, 2.0, 0.0])  # exp(0), exp(ln 1.5), min(4, cap 2), padding
    assert not w.requires_grad
    w_bool = truncated_is_weights(old, engine, mask.bool(), cap=2.0)
    assert_close(w_bool, w)


def test_mismatch_metrics():
    engine = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, 9.0, 9.0]])
    trainer = torch.tensor([[-1.05, -2.3, -0.5], [-0.15, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    m = mismatch_metrics(engine, trainer, mask, threshold=0.1)
    # Δ = engine - trainer = [0.05, 0.3, 0, -0.05]; padding Δ = 9 must not count
    assert_close(m["mismatch/logp_abs_mean"], 0.1)  # 0.4 / 4
    assert_close(m["mismatch/logp_abs_max"], 0.3)
    assert_close(m["mismatch/frac_above_threshold"], 0.25)  # only 0.3 > 0.1
    # trainer ppl / engine ppl = exp(1.0) / exp(0.925) = exp(mean Δ = 0.075) = 1.0778842
    assert_close(m["mismatch/ppl_ratio"], math.exp(0.075))


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
    assert_close(w, [[1.5, 2.0, 0.25, 0], [0.8, 1.25, 0, 0]])
    assert_close(m["rollout_corr/weight_mean"], 5.8 / 5)
    assert_close(m["rollout_corr/weight_max"], 2.0)
    assert_close(m["rollout_corr/masked_frac"], 0.0)
    assert_close(m["rollout_corr/truncated_frac"], 1 / 5)


def test_sequence_tis_geometric_mean():
    w, keep, m = _rc("seq_tis", rollout_correction_cap=2.0)
    assert keep is None
    assert_close(w, [[GEO0, GEO0, GEO0, 0], [1.0, 1.0, 0, 0]])
    assert_close(m["rollout_corr/weight_mean"], (3 * GEO0 + 2) / 5)
    assert_close(m["rollout_corr/truncated_frac"], 0.0)
    # cap 1.1 truncates row 0 (3 of 5 tokens)
    w, _, m = _rc("seq_tis", rollout_correction_cap=1.1)
    assert_close(w, [[1.1, 1.1, 1.1, 0], [1.0, 1.0, 0, 0]])
    assert_close(m["rollout_corr/truncated_frac"], 3 / 5)
    assert not sequence_tis_weights(OLD.clone().requires_grad_(), ENGINE, RC_MASK, 2.0).requires_grad


def test_token_masked_is():
    w, keep, m = _rc("token_mis", rollout_correction_lower=0.5, rollout_correction_upper=2.0)
    # 4.0 > 2 and 0.25 < 0.5 are dropped
    assert_close(keep, [[1, 0, 0, 0], [1, 1, 0, 0]])
    assert_close(w, [[1.5, 0, 0, 0], [0.8, 1.25, 0, 0]])
    assert_close(m["rollout_corr/masked_frac"], 2 / 5)
    assert_close(m["rollout_corr/weight_mean"], 3.55 / 3)
    assert_close(m["rollout_corr/weight_max"], 1.5)
    assert "rollout_corr/truncated_frac" not in m


def test_sequence_masked_is():
    w, keep, m = _rc("seq_mis", rollout_correction_lower=0.9, rollout_correction_upper=1.1)
    # row 0's geometric mean 1.1447 > 1.1: the whole sequence is dropped; row 1 (1.0) stays
    assert_close(keep, [[0, 0, 0, 0], [1, 1, 0, 0]])
    assert_close(w, [[0, 0, 0, 0], [1.0, 1.0, 0, 0]])
    assert_close(m["rollout_corr/masked_frac"], 3 / 5)
    assert_close(m["rollout_corr/weight_mean"], 1.0)
    with pytest.raises(ValueError, match="level"):
        masked_is(OLD, ENGINE, RC_MASK, 0.5, 2.0, "batch")
