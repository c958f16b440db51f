"""KL estimators between the policy and the frozen reference, and KL as a reward penalty.

Where the KL goes is `algorithm.kl_in`::

    kl_in=loss:   loss = pg_loss + kl_coef * aggregate(kl_penalty(logp, ref_logp, est), mask, mode)
    kl_in=reward: token_kl = kl_penalty(old_logp, ref_logp, est)       # no gradient, before advantages
                  adv, ret = compute_advantages(cfg, scores, mask, token_kl=token_kl)
"""

from __future__ import annotations

import torch

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
"""Canonical estimator names; the rest of the code only ever sees these."""

KL_ALIASES: dict[str, str] = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
"""verl's names for the same estimators (`algorithm.kl_penalty` / `actor.kl_loss_type`)."""

# exp() of a log-ratio beyond this overflows to inf in low precision (and at padding garbage),
# and inf - inf is NaN. Same bound as verl.
_MAX_LOG_RATIO = 20.0
# verl clamps each token's k3 value to [-10, 10]: one token whose reference log-prob exceeds the
# policy's by 11 would otherwise contribute exp(11) - 12 ~ 6e4 and dominate the whole update.
K3_CLAMP = 10.0


def canonical_kl_estimator(name: str) -> str:
    """The canonical name of a KL estimator (`kl` -> k1, `mse` -> k2, `low_var_kl` -> k3); ValueError if unknown."""
    name = KL_ALIASES.get(name, name)
    if name not in KL_ESTIMATORS:
        known = ", ".join((*KL_ESTIMATORS, *KL_ALIASES))
        raise ValueError(f"unknown KL estimator {name!r}; expected one of {known}")
    return name


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs (Schulman's k1/k2/k3).

    k1 = logp - ref_logp (unbiased, high variance, can be negative);
    k2 = 0.5 * (logp - ref_logp)^2;
    k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 (unbiased, >= 0, low variance), with the
         log-ratio clamped to [-20, 20] and the value clamped to [-10, 10] per token, as verl does;
    abs = |logp - ref_logp|.
    verl's aliases (kl, mse, low_var_kl) are accepted too.
    """
    estimator = canonical_kl_estimator(estimator)
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "abs":
        return log_ratio.abs()
    neg = (-log_ratio).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return (torch.exp(neg) - neg - 1.0).clamp(-K3_CLAMP, K3_CLAMP)


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
    [B, T] are token rewards (REINFORCE++, GAE): each response token gets its own penalty.
    `logp` is the rollout policy's (old) log-prob. Nothing here carries gradient.
    """
    with torch.no_grad():
        return subtract_kl(rewards, kl_penalty(logp, ref_logp, estimator), mask, kl_coef)


def subtract_kl(
    rewards: torch.Tensor, token_kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_kl_to_rewards` from an already computed per-token KL [B, T]; returns (rewards, seq KL [B]).

    Padding never contributes (even NaN there). [B] rewards lose kl_coef * the sequence's KL sum,
    [B, T] token rewards lose kl_coef * each token's KL.
    """
    m = mask.to(token_kl.dtype)
    kl = torch.where(m > 0, token_kl, torch.zeros_like(token_kl)) * m
    seq_kl = kl.sum(-1)
    if rewards.dim() == 1:
        return rewards - kl_coef * seq_kl, seq_kl
    if rewards.shape != kl.shape:
        raise ValueError(f"token rewards must have shape {tuple(kl.shape)}, got {tuple(rewards.shape)}")
    return rewards - kl_coef * kl, seq_kl
