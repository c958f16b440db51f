"""Reward pieces the PPO / reward-model tests pass by name (`reward.combine=tests.helpers.ppo_rewards:...`)."""

from __future__ import annotations

from hybridrl.rewards import RewardInput, per_sample


@per_sample
def response_length(item: RewardInput) -> float:
    """The response's length in characters (a reward whose value a test can predict)."""
    return float(len(item.response))


def max_of_sources(sources: dict[str, list[float]]) -> list[float]:
    """Per item, the largest score any source gave."""
    return [max(scores) for scores in zip(*sources.values())]
