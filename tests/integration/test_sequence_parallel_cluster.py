"""Sequence parallelism through the whole app: two local workers splitting every packed sequence between them
(`trainer.sequence_parallel_size=2`, one data-parallel rank) train like one worker, step for step.

With a critic and a reward model, so every trainer phase (log-probs, values, both updates) runs sequence parallel
and the reward phase is scattered over both ranks as before (reward models are not sequence parallel). The sampled
tokens and rewards must be the same, every loss, KL, entropy and gradient norm equal within float32 rounding."""

from __future__ import annotations

import pytest

from tests.integration.test_cluster import LOCAL2, PPO, AppRun, assert_all_gone, assert_same_metrics


@pytest.mark.multiproc
def test_two_sequence_parallel_workers_match_one_worker(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    algo = [*PPO[:-1], "trainer.steps=2", "trainer.max_tokens_per_micro_batch=48"]
    one = AppRun(algo, tmp_path / "one")
    assert one.wait() == 0, one.output[-3000:]
    two = AppRun([*LOCAL2, *algo, "trainer.sequence_parallel_size=2"], tmp_path / "two")
    assert two.wait() == 0, two.output[-3000:]
    assert_same_metrics(two.metrics(), one.metrics(), model_rewards=True)
    assert_all_gone(two.seen)
