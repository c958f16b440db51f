"""The controller's "advantages" phase: from a scored rollout batch to what the update trains on.

    metrics = estimate(cfg, batch, scores, extras)
    # batch now holds advantages [B, T] (and returns [B, T] for ppo, with critic/* metrics), and with a rollout
    # correction the
    # importance weights and the loss mask; metrics hold reward/*, rollout_corr/*, mismatch/*, actor/entropy

In order: reward metrics of the raw scores → DAPO's overlong shaping → the KL to the reference in the reward
(where `algorithm.kl_in=reward`) → the estimator `algorithm.name` picks → the rollout correction. The math is in
`hybridrl.algorithms`; this module only feeds it the batch's tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridrl.algorithms import (
    AlgorithmConfig,
    compute_advantages,
    explained_variance,
    kl_penalty,
    masked_mean,
    mismatch_metrics,
    overlong_penalty,
    rollout_correction,
)
from hybridrl.batch import Batch


def shaped_scores(algo: AlgorithmConfig, scores: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Scores with DAPO's overlong penalty added (the scores themselves when it is off)."""
    if not algo.overlong_buffer:
        return scores
    buffer = algo.overlong_buffer_tokens(max_new_tokens)
    return scores + overlong_penalty(mask.sum(-1), max_new_tokens, buffer, algo.overlong_penalty_factor)


def reward_metrics(scores: torch.Tensor, extras: dict[str, list[float]], group_size: int) -> dict[str, float]:
    """`reward/*` of the raw scores: mean, std, max, each component, and how many groups carry no signal."""
    m = {
        "reward/mean": scores.mean().item(),
        "reward/std": scores.std().item() if len(scores) > 1 else 0.0,
        "reward/max": scores.max().item(),
    }
    m.update({f"reward/{k}": sum(v) / len(v) for k, v in extras.items()})
    groups = scores.view(-1, group_size)
    m["reward/solve_none_frac"] = (groups.max(-1).values <= 0).float().mean().item()
    m["reward/zero_std_frac"] = (groups.std(-1) == 0).float().mean().item() if group_size > 1 else 0.0
    return m


def value_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How well the critic's rollout values predicted GAE's returns (verl's `critic/vf_explained_var`, computed on the
    values before this step's critic update): `critic/values_mean`, `critic/returns_mean`, `critic/explained_var`."""
    return {
        "critic/values_mean": masked_mean(values, mask).item(),
        "critic/returns_mean": masked_mean(returns, mask).item(),
        "critic/explained_var": explained_variance(values, returns, mask).item(),
    }


def estimate(
    algo: AlgorithmConfig, batch: Batch, scores: list[float], extras: dict[str, list[float]], max_new_tokens: int
) -> dict[str, Any]:
    """Advantages (and returns, weights, loss mask) into `batch`; the step's reward and rollout metrics."""
    raw = torch.tensor(scores, dtype=torch.float32)
    mask = batch["response_mask"]
    metrics: dict[str, Any] = reward_metrics(raw, extras, algo.group_size)
    shaped = shaped_scores(algo, raw, mask, max_new_tokens)
    if algo.overlong_buffer:
        metrics["reward/overlong_penalty_mean"] = (shaped - raw).mean().item()
    token_kl = None
    if algo.kl_in_reward and "ref_logprobs" in batch:
        token_kl = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], algo.kl_estimator)
        token_kl = torch.where(mask > 0, token_kl, torch.zeros_like(token_kl))
        metrics["reward/kl_penalty_mean"] = token_kl.sum(-1).mean().item()
    values = batch.tensors.get("values")
    advantages, returns = compute_advantages(algo, shaped, mask, token_kl=token_kl, values=values)
    batch["advantages"] = advantages
    if returns is not None:
        batch["returns"] = returns
    if returns is not None and values is not None:
        metrics.update(value_metrics(values, returns, mask))
    weights, keep, corr = rollout_correction(algo, batch["old_logprobs"], batch["engine_logprobs"], mask)
    if weights is not None:
        batch["is_weights"] = weights
    if keep is not None:
        batch["loss_mask"] = keep.to(mask.dtype)
    metrics.update({k: float(v) for k, v in corr.items()})
    if "entropy" in batch:  # of the rollout policy on its own samples (computed in the logprob pass)
        metrics["actor/entropy"] = masked_mean(batch["entropy"], mask).item()
    metrics.update(
        {k: float(v) for k, v in mismatch_metrics(batch["engine_logprobs"], batch["old_logprobs"], mask).items()}
    )
    return metrics
