"""Pure tensor math of the RL objective: advantages, policy and value losses, KL, aggregation, DAPO's
data pieces, rollout correction.

No I/O and no model here; the controller computes advantages, the trainer calls the losses.
`compute_advantages` and `policy_loss` pick the math for `algorithm.name` (docs/algorithms.md).
"""

from hybridrl.algorithms.advantages import (
    broadcast_to_tokens,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from hybridrl.algorithms.config import ALGORITHMS, AlgorithmConfig
from hybridrl.algorithms.correction import (
    ROLLOUT_CORRECTIONS,
    masked_is,
    mismatch_metrics,
    rollout_correction,
    sequence_tis_weights,
    truncated_is_weights,
)
from hybridrl.algorithms.dapo import GroupRefill, RefillPlan, groups_with_signal, overlong_penalty
from hybridrl.algorithms.kl import (
    KL_ALIASES,
    KL_ESTIMATORS,
    apply_kl_to_rewards,
    canonical_kl_estimator,
    kl_penalty,
    subtract_kl,
)
from hybridrl.algorithms.losses import (
    LOSS_AGG_MODES,
    aggregate,
    aggregation_denominator,
    cispo_loss,
    entropy_from_logits,
    gspo_loss,
    masked_mean,
    ppo_clip_loss,
)
from hybridrl.algorithms.objective import compute_advantages, policy_loss
from hybridrl.algorithms.returns import (
    discounted_returns,
    gae_advantages,
    last_token_rewards,
    reinforce_pp_advantages,
)
from hybridrl.algorithms.value_loss import clipped_value_loss, explained_variance
from hybridrl.algorithms.whiten import masked_var, masked_whiten

__all__ = [
    "ALGORITHMS",
    "KL_ALIASES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "ROLLOUT_CORRECTIONS",
    "AlgorithmConfig",
    "GroupRefill",
    "RefillPlan",
    "aggregate",
    "aggregation_denominator",
    "apply_kl_to_rewards",
    "broadcast_to_tokens",
    "canonical_kl_estimator",
    "cispo_loss",
    "clipped_value_loss",
    "compute_advantages",
    "discounted_returns",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "groups_with_signal",
    "grpo_advantages",
    "gspo_loss",
    "kl_penalty",
    "last_token_rewards",
    "masked_is",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "overlong_penalty",
    "policy_loss",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "rollout_correction",
    "sequence_tis_weights",
    "subtract_kl",
    "truncated_is_weights",
]
