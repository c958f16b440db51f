"""The app with engine=vllm end to end (real vLLM on CPU): a 3-step run and its mismatch metrics."""

from __future__ import annotations

import pytest

from tests.unit.engines.vllm.vllm_helpers import run_with_vllm

pytestmark = pytest.mark.vllm


def test_three_step_run_with_vllm(tmp_path):
    _, rows = run_with_vllm(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        # vLLM's log-probs against the trainer's on the same tokens, every step (float32 CPU).
        assert row["mismatch/logp_abs_mean"] < 1e-4, row["mismatch/logp_abs_mean"]
        assert row["mismatch/logp_abs_max"] < 1e-3
        assert 0.0 <= row["mismatch/frac_above_threshold"] <= 0.0 + 1e-9
    # The engine followed the trainer: after steps of updates the rollouts still match the trainer's log-probs,
    # which they could not if the reshard had not reached vLLM.
    assert rows[-1]["actor/kl"] > 0


def test_two_workers_with_vllm_tensor_parallel(tmp_path):
    """cluster=local with 2 worker processes forming one vLLM TP=2 engine (external_launcher in our group)."""
    _, rows = run_with_vllm(tmp_path, "cluster=local", "cluster.workers_per_node=2", "engine.tp_size=2", steps=2)
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["mismatch/logp_abs_mean"] < 1e-4 for row in rows)
