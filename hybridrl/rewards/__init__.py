"""Verifiable rewards and reward models behind one batched call signature (see `base` for the contract).

Importing this package registers the built-in rewards: "math", "format", "math_with_format", "countdown", "shapes".
"""

from hybridrl.rewards.base import (
    PerSampleRewardFn,
    RewardFn,
    RewardInput,
    RewardResult,
    batched,
    normalize_results,
    per_sample,
)
from hybridrl.rewards.config import RewardConfig

# Importing these modules registers their rewards.
from hybridrl.rewards.countdown import countdown_reward
from hybridrl.rewards.format import format_reward, math_with_format_reward
from hybridrl.rewards.math_answer import answers_match, extract_answer, math_reward, normalize_number
from hybridrl.rewards.registry import register_reward, registered_rewards, resolve_reward
from hybridrl.rewards.shapes import shapes_reward

__all__ = [
    "PerSampleRewardFn",
    "RewardConfig",
    "RewardFn",
    "RewardInput",
    "RewardResult",
    "answers_match",
    "countdown_reward",
    "batched",
    "extract_answer",
    "format_reward",
    "math_reward",
    "math_with_format_reward",
    "normalize_number",
    "normalize_results",
    "per_sample",
    "register_reward",
    "registered_rewards",
    "resolve_reward",
    "shapes_reward",
]
