"""Token-level returns and advantages: REINFORCE++ and GAE, computed on the controller::

    token_rewards = last_token_rewards(scores, mask)                       # outcome at the last token
    token_rewards, _ = subtract_kl(token_rewards, token_kl, mask, kl_coef)   # kl_in=reward
    adv, returns = gae_advantages(token_rewards, values, mask, gamma, lam)   # ppo (returns: critic target)
    adv, returns = reinforce_pp_advantages(token_rewards, mask, gamma)       # reinforce_pp

Recurrences run backwards over the positions where `mask` is 1. A masked position inside a response
(a tool's output in an agent rollout) is skipped: the recurrence carries over it undiscounted, as
verl's GAE does, and it gets 0. Every output is 0 where `mask` is 0.
"""

from __future__ import annotations

import torch

from hybridrl.algorithms.whiten import masked_whiten


def _masked(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x where m > 0, else 0 (so NaN/inf garbage at padding never reaches a sum)."""
    return torch.where(m > 0, x, torch.zeros_like(x))


@torch.no_grad()
def last_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Outcome rewards [B] as token rewards [B, T]: each score at its sequence's last response token
    (the last position where `mask` is nonzero, verl's placement), 0 elsewhere. A sequence without
    response tokens carries no reward."""
    if scores.dim() != 1 or mask.dim() != 2 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores must be [B] and mask [B, T]; got {tuple(scores.shape)} and {tuple(mask.shape)}")
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=-1).values  # [B]
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    has = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has]
    out[rows, last[has]] = scores[has]
    return out


@torch.no_grad()
def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_t' over response tokens, t' the next response token; [B, T], 0 at padding.

    Rewards at masked positions are ignored. For a contiguous, right-padded mask this is verl's
    REINFORCE++ return; verl resets the running return at every masked position, so over a hole in
    the mask (tool output) tokens before it would lose the outcome reward: here the return carries
    over the hole instead, as GAE does.
    """
    m = mask.to(token_rewards.dtype)
    rewards = _masked(token_rewards, m)
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        running = torch.where(m[:, t] > 0, rewards[:, t] + gamma * running, running)
        out[:, t] = running * m[:, t]
    return out


@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu et al. 2025): discounted returns of token rewards (KL already in them), whitened
    over all response tokens of the batch. Returns (advantages, returns), both [B, T], 0 at padding."""
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2015) over response tokens, as verl computes it.

    `values[:, t]` is the critic's V(s_t), the state before response token t (prompt + response[:t]);
    the state after the last response token is terminal (value 0). Backwards over response tokens:

        delta_t = r_t + gamma * V(next response token) - V_t
        A_t     = delta_t + gamma * lam * A(next response token)

    Returns (advantages whitened over the batch's response tokens, returns = A + V before whitening:
    the critic's targets), both [B, T] and 0 at padding.
    """
    m = mask.to(token_rewards.dtype)
    rewards = _masked(token_rewards, m)
    values = _masked(values.to(token_rewards.dtype), m)
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    last_gae = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        keep = m[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = torch.where(keep, values[:, t], next_value)
        last_gae = torch.where(keep, gae_t, last_gae)
        adv[:, t] = last_gae * m[:, t]
    returns = (adv + values) * m
    return masked_whiten(adv, m), returns
