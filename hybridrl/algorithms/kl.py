"""KL estimators between the policy and the frozen reference, and KL as a reward penalty.

Where the KL goes is `algorithm.kl_in`::

    kl_in=loss:   loss = pg_loss + kl_coef * aggregate(kl_penalty(logp, ref_logp, est), mask, mode)
    kl_in=reward: rewards, seq_kl = apply_kl_to_rewards(rewards, old_logp, ref_logp, mask, kl_coef, est)
                  (before advantages are computed)
"""

from __future__ import annotations

import torch

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")

# exp() of a log-ratio beyond this overflows to inf in low precision (and at padding garbage),
# and inf - inf is NaN; exp(20) ~ 5e8 is still finite and already a huge penalty.
_MAX_LOG_RATIO = 20.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs (Schulman's k1/k2/k3).

    k1 = logp - ref_logp (unbiased, high variance, can be negative);
    k2 = 0.5 * (logp - ref_logp)^2;
    k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 (unbiased, always >= 0, low variance).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    neg = (-log_ratio).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(neg) - neg - 1.0


def apply_kl_to_rewards(
    rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    estimator: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Subtract a KL penalty from rewards (kl_in=reward); returns (new rewards, per-sequence KL [B]).

    `rewards` of shape [B] are outcome rewards, as GRPO's advantages are outcome-level: the penalty is
    sequence-level, r - kl_coef * sum over response tokens of the estimator. `rewards` of shape
    [B, T] are token rewards (for a critic/GAE later): each response token gets its own penalty.
    `logp` is the rollout policy's (old) log-prob. Nothing here carries gradient.
    """
    m = mask.to(logp.dtype)
    with torch.no_grad():
        kl = kl_penalty(logp, ref_logp, estimator)
        kl = torch.where(m > 0, kl, torch.zeros_like(kl)) * m
        seq_kl = kl.sum(-1)
        if rewards.dim() == 1:
            return rewards - kl_coef * seq_kl, seq_kl
        if rewards.shape != kl.shape:
            raise ValueError(f"token rewards must have shape {tuple(kl.shape)}, got {tuple(rewards.shape)}")
        return rewards - kl_coef * kl, seq_kl
