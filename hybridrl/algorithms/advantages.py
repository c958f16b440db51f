"""Outcome advantages relative to the prompt's group, computed on the controller after rewards.

Each takes outcome rewards `[B]` where a prompt's `group_size` samples are contiguous::

    adv = grpo_advantages(rewards, cfg.group_size, cfg.norm_adv_by_std)   # [B]
    token_adv = broadcast_to_tokens(adv, response_mask)                     # [B, T]

`compute_advantages` (hybridrl.algorithms.objective) picks the estimator from the config.
"""

from __future__ import annotations

import torch

from hybridrl.algorithms.whiten import masked_whiten


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """`rewards[B]` as `[B / group_size, group_size]`, with a clear error for a bad batch."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards are not divisible by group_size={group_size}; "
            "each prompt must contribute exactly group_size contiguous samples"
        )
    return rewards.view(-1, group_size)


def _zero_equal_groups(groups: torch.Tensor, centered: torch.Tensor) -> torch.Tensor:
    """Exactly 0 for groups whose rewards are all equal: they carry no signal, and float rounding
    of their mean must not leak through (or be amplified by 1 / eps)."""
    all_equal = (groups == groups[:, :1]).all(dim=-1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(centered), centered).view(-1)


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages: (r - group mean) / (group std + eps), std unbiased as in verl/DeepSeek.

    A prompt's `group_size` samples are contiguous in `rewards[B]`. With `norm_by_std=False` the
    advantage is r - group mean (Dr. GRPO). A group whose rewards are all equal gets exactly 0: it
    carries no learning signal, and float rounding of its mean must not be amplified by 1/eps.
    """
    groups = _grouped(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(rewards)  # nothing to compare against (and the unbiased std is undefined)
    centered = groups - groups.mean(dim=-1, keepdim=True)
    if norm_by_std:
        centered = centered / (groups.std(dim=-1, keepdim=True) + eps)
    return _zero_equal_groups(groups, centered)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): r_i - mean of the other samples of the group.

    Written as n / (n - 1) * (r_i - group mean), verl's form (the same number). A single sample has
    no others to compare with and gets 0; an all-equal group gets exactly 0.
    """
    groups = _grouped(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(rewards)
    centered = (groups - groups.mean(dim=-1, keepdim=True)) * (group_size / (group_size - 1))
    return _zero_equal_groups(groups, centered)


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025): r - group mean on every response token, then whitened
    over all response tokens of the batch (mean 0, unbiased std 1, token-weighted as in verl). [B, T]."""
    groups = _grouped(rewards, group_size)
    if group_size > 1:
        centered = _zero_equal_groups(groups, groups - groups.mean(dim=-1, keepdim=True))
    else:
        centered = rewards  # a lone sample has no baseline (verl: group mean 0)
    return masked_whiten(broadcast_to_tokens(centered, mask), mask)


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every response token of a sequence that sequence's advantage: [B] -> [B, T], 0 at padding."""
    return advantages.unsqueeze(-1) * mask.to(advantages.dtype)
