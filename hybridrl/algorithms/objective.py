"""From the config to the math: which advantage estimator and which policy loss `algorithm.name` means.

On the controller, after rewards (and, for ppo, the critic's values)::

    token_kl = kl_penalty(old_logp, ref_logp, cfg.kl_estimator) if cfg.kl_in_reward else None
    adv, returns = compute_advantages(cfg, scores, mask, token_kl=token_kl, values=values)

In the trainer's micro-step::

    loss, metrics = policy_loss(cfg, logp, old_logp, adv, mask, normalizer, is_weights)

Where the KL enters, with kl_in=reward (subtracted from rewards before advantages, no gradient):

- outcome estimators (grpo, dr_grpo, dapo, gspo, cispo, rloo, reinforce_pp_baseline): each score
  loses kl_coef * the sum of its response's token KL, then the group baseline is taken (verl sums
  the KL-penalized token rewards into the score the same way);
- reinforce_pp and ppo (token-level): the score sits on the last response token and every response
  token loses kl_coef * its own KL; the discounted returns / GAE then run over these token rewards.

With kl_in=loss the trainer adds kl_coef * aggregate(kl_penalty(logp, ref_logp)) to the loss instead.
"""

from __future__ import annotations

import torch

from hybridrl.algorithms.advantages import (
    broadcast_to_tokens,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from hybridrl.algorithms.config import AlgorithmConfig
from hybridrl.algorithms.kl import subtract_kl
from hybridrl.algorithms.losses import cispo_loss, gspo_loss, ppo_clip_loss
from hybridrl.algorithms.returns import gae_advantages, last_token_rewards, reinforce_pp_advantages


@torch.no_grad()
def compute_advantages(
    cfg: AlgorithmConfig,
    scores: torch.Tensor,
    mask: torch.Tensor,
    *,
    token_kl: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-level advantages [B, T] (0 at padding) for `cfg.name`, and the critic's returns [B, T] (ppo
    only, else None).

    `scores` [B]: outcome rewards (shaping such as the overlong penalty already added), a prompt's
    `group_size` samples contiguous. `mask` [B, T]: response mask. `token_kl` [B, T]: the rollout
    policy's per-token KL to the reference (`kl_penalty(old_logp, ref_logp, cfg.kl_estimator)`),
    required when `cfg.kl_in_reward`. `values` [B, T]: the critic's values of the rollout, required
    for ppo.
    """
    if scores.dim() != 1 or mask.dim() != 2 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores must be [B] and mask [B, T]; got {tuple(scores.shape)} and {tuple(mask.shape)}")
    if cfg.kl_in_reward and token_kl is None:
        raise ValueError(f"algorithm.kl_in=reward needs token_kl (the rollout's per-token KL) for {cfg.name}")
    if cfg.needs_critic and values is None:
        raise ValueError("algorithm=ppo needs the critic's values of the rollout to compute GAE")
    estimator = cfg.adv_estimator
    kl = token_kl if cfg.kl_in_reward else None

    if estimator in ("reinforce_pp", "gae"):
        rewards = last_token_rewards(scores, mask)
        if kl is not None:
            rewards, _ = subtract_kl(rewards, kl, mask, cfg.kl_coef)
        if estimator == "gae":
            return gae_advantages(rewards, values, mask, cfg.gamma, cfg.lam)
        adv, _ = reinforce_pp_advantages(rewards, mask, cfg.gamma)
        return adv, None

    if kl is not None:
        scores, _ = subtract_kl(scores, kl, mask, cfg.kl_coef)
    if estimator == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(scores, mask, cfg.group_size), None
    if estimator == "rloo":
        adv = rloo_advantages(scores, cfg.group_size)
    else:  # grpo, dr_grpo, dapo, gspo, cispo
        adv = grpo_advantages(scores, cfg.group_size, norm_by_std=cfg.norm_adv_by_std and cfg.name != "dr_grpo")
    return broadcast_to_tokens(adv, mask), None


def policy_loss(
    cfg: AlgorithmConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: float | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss `cfg.name` uses, aggregated by `cfg.loss_agg_mode`: (loss, detached metrics).

    ppo_clip (grpo, dr_grpo, dapo, rloo, reinforce_pp*, ppo): `ppo_clip_loss` with clip_ratio_low/high
    and the dual clip; gspo: `gspo_loss` (sequence ratio, seq-mean-token-mean); cispo: `cispo_loss`.
    `normalizer` is the sum of `aggregation_denominator(mb_mask, cfg.loss_agg_mode)` over the
    mini-batch's micro-batches (divided by the data-parallel world), as for every loss here.
    Metrics: clip_frac, ppo_kl, ratio_mean (+ dual_clip_frac for ppo_clip).
    """
    kind = cfg.policy_loss_type
    if kind == "gspo":
        return gspo_loss(
            logp, old_logp, advantages, mask, cfg.clip_ratio_low, cfg.clip_ratio_high, normalizer, is_weights
        )
    if kind == "cispo":
        return cispo_loss(
            logp,
            old_logp,
            advantages,
            mask,
            cfg.clip_ratio_low,
            cfg.clip_ratio_high,
            cfg.loss_agg_mode,
            normalizer,
            is_weights,
        )
    return ppo_clip_loss(
        logp,
        old_logp,
        advantages,
        mask,
        cfg.clip_ratio_low,
        cfg.clip_ratio_high,
        cfg.clip_ratio_c,
        cfg.loss_agg_mode,
        normalizer=normalizer,
        is_weights=is_weights,
    )
