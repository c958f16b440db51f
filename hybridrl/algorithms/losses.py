"""Policy-gradient losses and how a per-token loss matrix becomes one scalar.

A trainer's update over one mini-batch, split into micro-batches for memory::

    norm = sum(aggregation_denominator(mb.mask, mode) for mb in minibatch)   # global, before any backward
    for mb in minibatch:
        loss, metrics = ppo_clip_loss(logp, mb.old_logp, mb.adv, mb.mask, ..., normalizer=norm)
        loss.backward()                                                  # grads add up to the full-batch grad
    optimizer.step()
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

# exp() of a log-ratio beyond this overflows to inf in low precision and turns 0 * inf into NaN.
_MAX_LOG_RATIO = 20.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is nonzero; 0 when the mask is empty.

    Masked-out values never reach the result, even when they are inf or NaN (padding garbage).
    """
    m = mask.to(x.dtype)
    x = torch.where(m > 0, x, torch.zeros_like(x))
    return (x * m).sum() / m.sum().clamp(min=1)


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGG_MODES}")


def aggregation_denominator(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What `aggregate` divides by for this `mask` (a 0-d tensor).

    token-mean: the number of response tokens; seq-mean-token-sum and seq-mean-token-mean: the number
    of sequences with at least one response token; seq-mean-token-sum-norm: that number times T
    (`mask.shape[-1]`). Sum it over every micro-batch of a mini-batch to get `aggregate`'s `normalizer`.
    """
    _check_mode(mode)
    m = mask.float()
    if mode == "token-mean":
        return m.sum()
    n_seqs = (m.sum(-1) > 0).float().sum()
    if mode == "seq-mean-token-sum-norm":
        return n_seqs * mask.shape[-1]
    return n_seqs


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss `loss_mat[B, T]` to a scalar; positions where `mask` is 0 are ignored.

    Modes (sums run over response tokens only):

    - ``token-mean``: sum over all tokens / number of tokens (every token weighs the same; DAPO).
    - ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean (original GRPO).
    - ``seq-mean-token-sum-norm``: mean over sequences of token sum / T, with T = ``mask.shape[-1]``
      a constant length (Dr. GRPO); pad responses to a fixed length (max new tokens) for it to stay
      constant. Unlike verl's mode of the same name, this one also divides by the number of sequences.

    Sequences without any response token count for nothing in the seq-mean modes.

    `normalizer` replaces the local denominator (`aggregation_denominator(mask, mode)`). Passing the
    sum of that denominator over all micro-batches of a mini-batch makes the micro-batch gradients
    add up exactly to the gradient of one `aggregate` call over the whole mini-batch (for
    seq-mean-token-sum-norm when every micro-batch has the same T). Under data parallelism that
    averages gradients over W ranks, pass the global denominator divided by W.
    """
    _check_mode(mode)
    m = mask.to(loss_mat.dtype)
    # where() rather than a bare multiply, so NaN/inf at padding cannot leak into the sum.
    loss_mat = torch.where(m > 0, loss_mat, torch.zeros_like(loss_mat)) * m
    if mode == "seq-mean-token-mean":
        numerator = (loss_mat.sum(-1) / m.sum(-1).clamp(min=1)).sum()
    else:
        numerator = loss_mat.sum()
    if normalizer is None:
        # Counts are >= 1 unless the mask is empty; then 0 / 1 reports 0 (and a zero gradient), not NaN.
        return numerator / aggregation_denominator(mask, mode).to(numerator.dtype).clamp(min=1)
    if not isinstance(normalizer, torch.Tensor) and normalizer <= 0:
        raise ValueError(f"normalizer must be positive, got {normalizer}")
    return numerator / normalizer


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float,
    agg_mode: str,
    normalizer: float | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate with dual clip (the GRPO/DAPO policy loss), aggregated by `agg_mode`.

    Per token, with ratio = exp(logp - old_logp) and advantage A:

        clipped = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
        loss    = min(clipped, -A * clip_c) if A < 0 else clipped         # dual clip, clip_c > 1

    The dual clip bounds the loss of a negative-advantage token whose ratio has grown past clip_c,
    as in Ye et al. 2020 and verl. `is_weights` (rollout-correction weights per token) multiply
    the per-token loss and get no gradient. `advantages` is [B, T], or [B] and then broadcast.

    Returns the loss and detached 0-d metrics: `clip_frac` (tokens where the clipped term was the
    larger, so the token gets no gradient), `dual_clip_frac` (tokens where the dual clip was
    active), `ppo_kl` (mean of old_logp - logp), `ratio_mean`; all over masked tokens.
    """
    if advantages.dim() == logp.dim() - 1:
        advantages = advantages.unsqueeze(-1).expand_as(logp)
    log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = torch.minimum(loss_ppo, -advantages * clip_c)
    negative = advantages < 0
    loss_mat = torch.where(negative, loss_dual, loss_ppo)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate(loss_mat, mask, agg_mode, normalizer)

    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((loss_clipped > loss_unclipped).float(), mask),
            "dual_clip_frac": masked_mean((negative & (loss_ppo > -advantages * clip_c)).float(), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, metrics


# GSPO's sequence-level log-ratio is capped here before exp(), as verl does (exp(10) ~ 2.2e4).
_MAX_SEQ_LOG_RATIO = 10.0


def _token_advantages(advantages: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """[B] advantages broadcast to [B, T]; [B, T] passed through."""
    if advantages.dim() == logp.dim() - 1:
        return advantages.unsqueeze(-1).expand_as(logp)
    return advantages


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    normalizer: float | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): PPO-clip on the sequence-level importance ratio, GSPO-token form.

    The sequence ratio is the geometric mean of the token ratios over the response,
    s_i = exp(mean_t (logp - old_logp)). Each token carries s_i,t = sg[s_i] * pi / sg[pi], equal to
    s_i in value, so the clip (at 1 - clip_low, 1 + clip_high; the paper uses 3e-4 and 4e-4) acts on
    whole sequences, while the gradient flows per token: for an unclipped sequence,
    d loss / d logp_t = -A_i * s_i / |y_i| (divided by the number of sequences), as in the paper.

    Always aggregated as seq-mean-token-mean (GSPO's objective is a mean over sequences of the
    sequence term; verl forces the same mode), so pass the seq-mean-token-mean `normalizer`. No dual
    clip. `is_weights` multiply the per-token loss without gradient. Metrics as `ppo_clip_loss`
    (`clip_frac` over tokens, so each sequence counts by its length, as in verl).
    """
    m = mask.to(logp.dtype)
    advantages = _token_advantages(advantages, logp)
    # where() first: garbage at padding must reach neither the sequence mean nor the gradient.
    log_ratio = torch.where(m > 0, logp - old_logp, torch.zeros_like(logp))
    seq_log_ratio = log_ratio.sum(-1) / m.sum(-1).clamp(min=1)
    logp_resp = torch.where(m > 0, logp, torch.zeros_like(logp))
    log_s = logp_resp - logp_resp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(log_s.clamp(max=_MAX_SEQ_LOG_RATIO))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate(loss_mat, mask, "seq-mean-token-mean", normalizer)

    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((loss_clipped > loss_unclipped).float(), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, metrics


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    agg_mode: str,
    normalizer: float | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, Chen et al. 2025): clipped, detached importance weights times the advantage
    times the log-prob of every token:

        loss_t = -sg[clamp(ratio_t, 1 - clip_low, 1 + clip_high)] * A_t * logp_t

    Unlike PPO-clip no token is dropped from the gradient: the clip bounds the weight, and
    d loss / d logp_t = -w_t * A_t (over the aggregation's denominator). The paper sets no lower
    bound (a clip_low >= 1 does that; verl's example uses 10) and tunes only clip_high. The loss
    value is not comparable to PPO's (it contains logp). `clip_frac`: tokens whose weight was clipped.
    """
    m = mask.to(logp.dtype)
    advantages = _token_advantages(advantages, logp)
    with torch.no_grad():
        log_ratio = torch.where(m > 0, logp - old_logp, torch.zeros_like(logp)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        ratio = torch.exp(log_ratio)
        weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    logp_resp = torch.where(m > 0, logp, torch.zeros_like(logp))
    loss_mat = -weight * advantages * logp_resp
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate(loss_mat, mask, agg_mode, normalizer)

    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((weight != ratio).float(), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, as logsumexp(l) - sum(softmax(l) * l).

    This form never takes log(0), so it stays finite for very peaked distributions. Computed in
    the logits' dtype; upcast first if bf16 precision is not enough.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
