"""Per-token log-probs and entropy of a batch of responses under a causal LM."""

from __future__ import annotations

import torch

from hybridrl.algorithms import entropy_from_logits


def pack_sequences(prompts: list[list[int]], responses: torch.Tensor, response_mask: torch.Tensor, pad_id: int):
    """Right-padded prompt+response token ids [B, L], attention mask, and each row's prompt length.

    `responses` [B, R] is response-aligned (column j = the j-th generated token).
    """
    lens_r = response_mask.sum(-1).tolist()
    lengths = [len(p) + int(r) for p, r in zip(prompts, lens_r)]
    width = max(lengths)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, lens_r)):
        r = int(r)
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids[i, len(p) : len(p) + r] = responses[i, :r].cpu()
        attn[i, : len(p) + r] = 1
    return ids, attn, [len(p) for p in prompts]


def response_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    pad_id: int,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / temperature) at each response token, response-aligned [B, R].

    The same definition every engine uses for the sampled token, so ratios compare like with like.
    """
    device = responses.device
    ids, attn, plens = pack_sequences(prompts, responses, response_mask, pad_id)
    ids, attn = ids.to(device), attn.to(device)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    B, R = responses.shape
    # Logits at position t predict token t+1: response token j of row i sits at plen_i + j.
    idx = torch.tensor(plens, device=device)[:, None] + torch.arange(R, device=device)[None, :] - 1
    idx = idx.clamp(max=logits.shape[1] - 1)
    picked = logits.gather(1, idx[:, :, None].expand(B, R, logits.shape[-1])).float()
    t = temperature if temperature > 0 else 1.0
    scaled = picked / t
    logp = torch.log_softmax(scaled, dim=-1).gather(-1, responses[:, :, None]).squeeze(-1)
    logp = logp * response_mask
    ent = entropy_from_logits(scaled) * response_mask if with_entropy else None
    return logp, ent
