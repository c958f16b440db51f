"""Training-inference mismatch: the engine samples with its own kernels, so its log-probs differ from
the trainer's on the same tokens. Measured every step, and optionally corrected::

    metrics |= mismatch_metrics(engine_logp, old_logp, mask)
    if cfg.rollout_correction == "tis":
        w = truncated_is_weights(old_logp, engine_logp, mask, cfg.rollout_correction_cap)
        loss, m = ppo_clip_loss(..., is_weights=w)
"""

from __future__ import annotations

import math

import torch

from hybridrl.algorithms.losses import masked_mean


def truncated_is_weights(
    old_logp_trainer: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Token-level truncated importance weights min(exp(old_logp_trainer - engine_logp), cap).

    They reweight samples drawn by the engine's policy toward the trainer's old policy (TIS, Yao et
    al. 2025); the cap bounds the variance. Detached, and 0 at padding.
    """
    # Clamping the log first keeps exp() finite; the cap then does the real truncation.
    log_w = (old_logp_trainer - engine_logp).detach().clamp(max=math.log(cap))
    w = torch.exp(log_w)
    return torch.where(mask > 0, w, torch.zeros_like(w))


def mismatch_metrics(
    engine_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor, threshold: float = 0.1
) -> dict[str, torch.Tensor]:
    """Detached 0-d metrics of Δ = engine_logp - trainer_logp over response tokens.

    `mismatch/logp_abs_mean` and `mismatch/logp_abs_max`: mean and max of |Δ|;
    `mismatch/frac_above_threshold`: fraction of tokens with |Δ| > threshold;
    `mismatch/ppl_ratio`: trainer perplexity / engine perplexity = exp(mean Δ) (token-mean), 1 when equal.
    Returned as tensors so the caller can move all metrics to the host in one sync.
    """
    with torch.no_grad():
        delta = engine_logp.float() - trainer_logp.float()
        delta = torch.where(mask > 0, delta, torch.zeros_like(delta))
        abs_delta = delta.abs()
        return {
            "mismatch/logp_abs_mean": masked_mean(abs_delta, mask),
            # Padding is 0 and |Δ| >= 0, so the plain max is the max over response tokens (0 if none).
            "mismatch/logp_abs_max": abs_delta.max() if abs_delta.numel() else abs_delta.new_zeros(()),
            "mismatch/frac_above_threshold": masked_mean((abs_delta > threshold).float(), mask),
            "mismatch/ppl_ratio": torch.exp(masked_mean(delta, mask)),
        }
