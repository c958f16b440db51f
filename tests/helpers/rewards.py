"""Reward functions tests pass to the app as `reward.fn=tests.helpers.rewards:<name>` (run from the repo root)."""

from __future__ import annotations

from hybridrl.rewards import RewardInput, per_sample


@per_sample
def half_the_groups_flat(item: RewardInput) -> float:
    """Every sample of a prompt whose task digits sum to an even number scores 0.5 (a flat group, no signal); the
    others score the share of digits in the response (groups that differ). Dynamic sampling must drop the flat ones."""
    digits = [int(c) for c in item.prompt if c.isdigit()]
    if sum(digits) % 2 == 0:
        return 0.5
    return sum(c.isdigit() for c in item.response) / max(1, len(item.response))
