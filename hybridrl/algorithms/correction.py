"""Training-inference mismatch: the engine samples with its own kernels, so its log-probs differ from
the trainer's on the same tokens. Measured every step, and optionally corrected (Yao et al. 2025,
"Your efficient RL framework secretly brings you off-policy RL training"; verl's rollout correction)::

    metrics |= mismatch_metrics(engine_logp, old_logp, mask)
    weights, keep, rc_metrics = rollout_correction(cfg, old_logp, engine_logp, mask)  # once per batch
    loss_mask = mask if keep is None else mask * keep
    loss, m = policy_loss(cfg, logp, old_logp, adv, loss_mask, normalizer, is_weights=weights)

The ratio is rho = pi_trainer_old / pi_engine = exp(old_logp - engine_logp), per token; a sequence's
ratio is the geometric mean of its token ratios, exp(mean over its response of log rho).
"""

from __future__ import annotations

import math

import torch

from hybridrl.algorithms.config import ROLLOUT_CORRECTIONS, AlgorithmConfig
from hybridrl.algorithms.losses import masked_mean

# Log-ratios are clamped to this before exp(), as verl's rollout correction does (its SAFETY_BOUND).
_SAFETY_BOUND = 20.0


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


def _log_ratio(old_logp_trainer: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log rho per token, detached, 0 at padding."""
    log_rho = (old_logp_trainer - engine_logp).detach()
    return torch.where(mask > 0, log_rho, torch.zeros_like(log_rho))


def _seq_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean log rho over each sequence's response tokens, [B, 1] (0 for an empty response)."""
    m = mask.to(log_rho.dtype)
    return (log_rho.sum(-1) / m.sum(-1).clamp(min=1)).unsqueeze(-1)


def sequence_tis_weights(
    old_logp_trainer: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Sequence-level TIS: every token of a sequence gets min(geometric-mean ratio of the sequence, cap).

    verl's `rollout_is: sequence` uses the product of the token ratios instead, which for long
    responses is nearly always far from 1; the geometric mean is length-normalized (as GSPO's ratio
    and verl's geometric rejection), so one cap suits every length. Detached, 0 at padding.
    """
    log_rho = _log_ratio(old_logp_trainer, engine_logp, mask)
    seq = _seq_log_ratio(log_rho, mask).clamp(-_SAFETY_BOUND, math.log(cap))
    w = torch.exp(seq).expand_as(log_rho)
    return torch.where(mask > 0, w, torch.zeros_like(w))


def masked_is(
    old_logp_trainer: torch.Tensor,
    engine_logp: torch.Tensor,
    mask: torch.Tensor,
    lower: float,
    upper: float,
    level: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked importance sampling: drop what leaves the trust region instead of truncating it.

    `level="token"`: a token whose ratio is outside [lower, upper] is dropped; `level="sequence"`: a
    whole sequence whose geometric-mean ratio is outside is dropped. Returns (weights, keep), both
    [B, T] and detached: `keep` is 1 where the token stays in the loss (0 at padding), `weights` the
    ratio (token or sequence) there, already within the bounds, and 0 where dropped.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    log_rho = _log_ratio(old_logp_trainer, engine_logp, mask)
    if level == "sequence":
        log_rho = _seq_log_ratio(log_rho, mask).expand_as(log_rho)
    rho = torch.exp(log_rho.clamp(-_SAFETY_BOUND, _SAFETY_BOUND))
    keep = (mask > 0) & (rho >= lower) & (rho <= upper)
    return torch.where(keep, rho, torch.zeros_like(rho)), keep.to(rho.dtype)


def rollout_correction(
    cfg: AlgorithmConfig, old_logp_trainer: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
    """The rollout correction `cfg.rollout_correction` asks for: (weights [B, T] or None, keep mask
    [B, T] or None, metrics).

    none: (None, None, {}); tis / seq_tis: truncated weights (cap `rollout_correction_cap`), no mask;
    token_mis / seq_mis: weights and a keep mask (bounds `rollout_correction_lower` / `_upper`).
    Both inputs are fixed for the whole update, so compute this once per batch, multiply the
    response mask by `keep` for the loss and its normalizer, and pass `weights` as `is_weights`.

    Metrics (detached 0-d tensors): `rollout_corr/weight_mean` and `rollout_corr/weight_max` over the
    tokens that stay, `rollout_corr/masked_frac` (share of response tokens dropped),
    `rollout_corr/truncated_frac` (TIS: share of tokens whose weight hit the cap).
    """
    mode = cfg.rollout_correction
    if mode == "none":
        return None, None, {}
    with torch.no_grad():
        keep = None
        if mode == "tis":
            w = truncated_is_weights(old_logp_trainer, engine_logp, mask, cfg.rollout_correction_cap)
        elif mode == "seq_tis":
            w = sequence_tis_weights(old_logp_trainer, engine_logp, mask, cfg.rollout_correction_cap)
        elif mode in ("token_mis", "seq_mis"):
            level = "token" if mode == "token_mis" else "sequence"
            w, keep = masked_is(
                old_logp_trainer, engine_logp, mask, cfg.rollout_correction_lower, cfg.rollout_correction_upper, level
            )
        else:
            raise ValueError(f"unknown rollout correction {mode!r}; expected one of {ROLLOUT_CORRECTIONS}")
        stays = mask if keep is None else keep
        metrics = {
            "rollout_corr/weight_mean": masked_mean(w, stays),
            "rollout_corr/weight_max": torch.where(stays > 0, w, torch.zeros_like(w)).max()
            if w.numel()
            else w.new_zeros(()),
            "rollout_corr/masked_frac": masked_mean(1.0 - stays.float(), mask),
        }
        if keep is None:
            log_rho = _log_ratio(old_logp_trainer, engine_logp, mask)
            if mode == "seq_tis":
                log_rho = _seq_log_ratio(log_rho, mask).expand_as(log_rho)
            hit = log_rho > math.log(cfg.rollout_correction_cap)
            metrics["rollout_corr/truncated_frac"] = masked_mean(hit.float(), mask)
    return w, keep, metrics
