"""Reward functions that take their time, for the deadline tests (`reward.fn=tests.helpers.slow_rewards:<name>`)."""

from __future__ import annotations

import time

from hybridrl.rewards import RewardInput, per_sample


@per_sample
def slow(item: RewardInput) -> float:
    """30 s per sample: without a deadline, a batch of 16 takes 8 minutes on the default 8 threads."""
    time.sleep(30)
    return 1.0
