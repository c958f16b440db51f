"""Outcome advantages, computed on the controller after rewards and before the update::

    adv = grpo_advantages(rewards, cfg.group_size, cfg.norm_adv_by_std)   # [B]
    token_adv = broadcast_to_tokens(adv, response_mask)                     # [B, T]
"""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages: (r - group mean) / (group std + eps), std unbiased as in verl/DeepSeek.

    A prompt's `group_size` samples are contiguous in `rewards[B]`. With `norm_by_std=False` the
    advantage is r - group mean (Dr. GRPO). A group whose rewards are all equal gets exactly 0: it
    carries no learning signal, and float rounding of its mean must not be amplified by 1/eps.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards are not divisible by group_size={group_size}; "
            "each prompt must contribute exactly group_size contiguous samples"
        )
    if group_size == 1:
        return torch.zeros_like(rewards)  # nothing to compare against (and the unbiased std is undefined)
    groups = rewards.view(-1, group_size)
    centered = groups - groups.mean(dim=-1, keepdim=True)
    if norm_by_std:
        centered = centered / (groups.std(dim=-1, keepdim=True) + eps)
    all_equal = (groups == groups[:, :1]).all(dim=-1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(centered), centered).view(-1)


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every response token of a sequence that sequence's advantage: [B] -> [B, T], 0 at padding."""
    return advantages.unsqueeze(-1) * mask.to(advantages.dtype)
