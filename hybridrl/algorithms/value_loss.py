"""The critic's loss (algorithm=ppo) and how well its values explain the returns.

The critic's update over one mini-batch mirrors the actor's (same `normalizer` mechanism)::

    norm = sum(aggregation_denominator(mb.mask, mode) for mb in minibatch) / world
    for mb in minibatch:
        loss, m = clipped_value_loss(critic(mb), mb.old_values, mb.returns, mb.mask, cliprange_value,
                                     mode, normalizer=norm)
        loss.backward()
"""

from __future__ import annotations

import torch

from hybridrl.algorithms.losses import aggregate, masked_mean
from hybridrl.algorithms.whiten import masked_var


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    agg_mode: str,
    normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss in verl's form, aggregated like the policy loss:

        clipped = old_values + clamp(values - old_values, -cliprange_value, cliprange_value)
        loss    = 0.5 * aggregate(max((values - R)^2, (clipped - R)^2), mask, agg_mode)

    `values` are the critic's current predictions (with gradient), `old_values` those of the rollout
    (the ones GAE used), `returns` GAE's returns. Metrics (detached, over masked tokens):
    `vf_clipfrac` (tokens where the clipped term was the larger), `vpred_mean`.
    """
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    loss_unclipped = (values - returns).square()
    loss_clipped = (clipped - returns).square()
    loss = 0.5 * aggregate(torch.maximum(loss_unclipped, loss_clipped), mask, agg_mode, normalizer)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask),
            "vpred_mean": masked_mean(values, mask),
        }
    return loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / (Var(returns) + 1e-5) over response tokens (unbiased, verl's
    `critic/vf_explained_var`): 1 is a perfect critic, 0 no better than a constant, < 0 worse."""
    with torch.no_grad():
        return 1.0 - masked_var(returns - values, mask) / (masked_var(returns, mask) + 1e-5)
