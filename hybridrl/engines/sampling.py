"""Batched next-token sampling with the log-prob definition shared by trainer and engines."""

from __future__ import annotations

import torch


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [B, V]; returns (tokens [B], logprobs [B]).

    The log-prob is log_softmax(logits / temperature) at the sampled token, taken before
    top-k/top-p filtering, so it equals what the trainer computes for the same token.
    temperature == 0 is greedy, with the log-prob at temperature 1.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    filtered = scaled
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        # The sort is the costly part at large vocab, so it only runs when top-p is on.
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        filtered = filtered.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(filtered, dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, without a CDF search.
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    tokens = (probs / noise).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
