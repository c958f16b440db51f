"""Pure tensor math of the RL objective: advantages, policy losses, KL, aggregation, rollout correction.

No I/O and no model here; the controller computes advantages, the trainer calls the losses.
"""

from hybridrl.algorithms.advantages import broadcast_to_tokens, grpo_advantages
from hybridrl.algorithms.config import AlgorithmConfig
from hybridrl.algorithms.correction import mismatch_metrics, truncated_is_weights
from hybridrl.algorithms.kl import KL_ESTIMATORS, apply_kl_to_rewards, kl_penalty
from hybridrl.algorithms.losses import (
    LOSS_AGG_MODES,
    aggregate,
    aggregation_denominator,
    entropy_from_logits,
    masked_mean,
    ppo_clip_loss,
)

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AlgorithmConfig",
    "aggregate",
    "aggregation_denominator",
    "apply_kl_to_rewards",
    "broadcast_to_tokens",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_penalty",
    "masked_mean",
    "mismatch_metrics",
    "ppo_clip_loss",
    "truncated_is_weights",
]
