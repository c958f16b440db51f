"""Packed, token-budgeted passes over two local workers train exactly like one padded worker.

One worker with the padded layout (`trainer.padding_free=false`, row micro-batches) is the reference; two workers
pack their rows under a token budget small enough that each rank runs several micro-batches and the ranks must agree
on how many (their rows differ in length). The sampled tokens and rewards must be the same, every loss, KL, entropy
and gradient norm equal within the 1-vs-2-worker rounding (FSDP sums over ranks in another order)."""

from __future__ import annotations

import pytest

from tests.integration.test_cluster import LOCAL2, PPO, AppRun, assert_all_gone, assert_same_metrics


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "algo",
    [
        ["trainer.steps=2"],
        # The critic's values and update, and a reward model's scores, packed too.
        [*PPO[:-1], "trainer.steps=2", "critic.max_tokens_per_micro_batch=48"],
    ],
    ids=["grpo", "ppo_critic_reward_model"],
)
def test_two_packed_workers_under_a_token_budget_match_one_padded_worker(tmp_path, algo):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = AppRun([*algo, "trainer.padding_free=false", "trainer.micro_batch_size=4"], tmp_path / "one")
    two = AppRun([*LOCAL2, *algo, "trainer.max_tokens_per_micro_batch=64"], tmp_path / "two")
    assert one.wait() == 0, one.output[-3000:]
    assert two.wait() == 0, two.output[-3000:]
    ref, rows = one.metrics(), two.metrics()
    assert_same_metrics(rows, ref, model_rewards="critic.lr=5e-3" in algo)
    # Packed, a micro-batch only rounds its length up (to a multiple of 8 at these sizes: under 8 positions each).
    assert all(0 <= r["perf/pad_frac"] < 0.2 for r in rows)
    assert_all_gone(two.seen)
