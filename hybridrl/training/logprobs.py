"""Per-token log-probs and entropy of a batch of responses under a causal LM: packed (`packed_logprobs`, what the
trainer runs by default) or right-padded (`response_logprobs`, `trainer.padding_free=false`)."""

from __future__ import annotations

import torch

from hybridrl.training import logprob_kernel
from hybridrl.training.chunked_logprobs import logprob_head
from hybridrl.training.logprob_kernel import fused_token_logprobs
from hybridrl.training.packing import PackedRows
from hybridrl.training.sequence_parallel import SequenceShard


def pad_sequences(prompts: list[list[int]], responses: torch.Tensor, response_mask: torch.Tensor, pad_id: int):
    """Right-padded prompt+response token ids [B, L], attention mask, and each row's prompt length.

    `responses` [B, R] is response-aligned (column j = the j-th generated token).
    """
    lens_r = response_mask.sum(-1).long().tolist()
    lengths = [len(p) + r for p, r in zip(prompts, lens_r)]
    width = max(lengths)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    resp_cpu = responses.cpu()
    for i, (p, r) in enumerate(zip(prompts, lens_r)):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids[i, len(p) : len(p) + r] = resp_cpu[i, :r]
        attn[i, : len(p) + r] = 1
    return ids, attn, [len(p) for p in prompts]


def in_chunks(chunk_size: int, positions: int) -> bool:
    """Whether a pass with logits at `positions` goes through the chunked head: `trainer.logprob_chunk_size` bounds
    the positions whose logits exist at once, so a pass within it keeps the plain head (no recomputed logits)."""
    return 0 < chunk_size < positions


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    kernel: bool = True,
    reuse_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / T)[target] and the entropy, per position, in float32.

    Written as logit[target] - logsumexp(logits) so no [.., V] log-softmax tensor is kept besides
    the logits themselves. With `kernel`, GPU logits go through the fused Triton pass (`logprob_kernel`), whose
    backward writes d(logits) over the logits when `reuse_logits` (a model's fresh output that nothing else reads).
    """
    if kernel and logprob_kernel.available(logits):
        lp, ent = fused_token_logprobs(logits, targets, temperature, reuse_logits)
        return lp, (ent if with_entropy else None)
    scaled = logits.float()
    if temperature not in (0.0, 1.0):
        scaled = scaled / temperature
    lse = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, targets[..., None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    probs = torch.softmax(scaled, dim=-1)
    entropy = lse - (probs * scaled).sum(-1)
    return logp, entropy


def response_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    pad_id: int,
    with_entropy: bool = False,
    chunk_size: int = 0,
    kernel: bool = True,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / temperature) at each response token, response-aligned [B, R].

    `attention_mask` [B, R] marks every real response token when that differs from `response_mask` (agent
    trajectories: tool outputs sit in the context but out of the loss); the model then reads all of them, and the
    returned log-probs are masked by `response_mask`.

    The same definition every engine uses for the sampled token, so ratios compare like with like.
    Logits are computed only from the shortest prompt's end onwards (`logits_to_keep`): the prompt
    part of the sequence never needs the vocabulary projection. With more kept positions than `chunk_size` (> 0)
    the log-probs come from `chunked_logprobs` (no [tokens, vocab] logits kept for the backward).
    """
    device = responses.device
    ids, attn, plens = pad_sequences(
        prompts, responses, response_mask if attention_mask is None else attention_mask, pad_id
    )
    ids, attn = ids.to(device), attn.to(device)
    B, R = responses.shape
    L = ids.shape[1]
    start = min(plens) - 1  # first position whose logits predict a response token
    keep = L - start
    # Targets of kept position k are the tokens at start + k + 1 (the last position has none).
    targets = torch.cat([ids[:, start + 1 :], ids.new_full((B, 1), pad_id)], dim=1)
    if in_chunks(chunk_size, B * keep):
        with logprob_head(model, targets, temperature, chunk_size, with_entropy, kernel):
            out = model(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=keep).logits
        lp, ent = out[..., 0], (out[..., 1] if with_entropy else None)
    else:
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=keep).logits  # [B, keep, V]
        lp, ent = token_logprobs_and_entropy(logits, targets, temperature, with_entropy, kernel, reuse_logits=True)
    # Response token j of row i is predicted at position plen_i - 1 + j, i.e. kept index plen_i - 1 + j - start.
    idx = torch.tensor(plens, device=device)[:, None] - 1 - start + torch.arange(R, device=device)[None, :]
    idx = idx.clamp(max=keep - 1)
    mask = response_mask.to(lp.dtype)
    logp = lp.gather(1, idx) * mask
    entropy = ent.gather(1, idx) * mask if ent is not None else None
    return logp, entropy


def packed_logprobs(
    model: torch.nn.Module,
    packed: PackedRows | SequenceShard,
    temperature: float,
    with_entropy: bool = False,
    chunk_size: int = 0,
    kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs` of a packed micro-batch (`training/packing.py`): the same values, response-aligned
    [rows, R] and 0 off the response mask, from one row of real tokens; logits only at the positions that predict
    a masked response token. Given a rank's sequence-parallel slice (`training/sequence_parallel.py`), the slice's
    forward and logits, and the whole micro-batch's log-probs on every rank of its group."""
    targets = packed.targets[None]
    inputs = packed.model_inputs()
    if in_chunks(chunk_size, packed.kept.numel()):
        with logprob_head(model, targets, temperature, chunk_size, with_entropy, kernel):
            out = model(**inputs, use_cache=False, logits_to_keep=packed.kept).logits
        lp, ent = out[0, :, 0], (out[0, :, 1] if with_entropy else None)
    else:
        logits = model(**inputs, use_cache=False, logits_to_keep=packed.kept).logits  # [1, K, V]
        lp, ent = token_logprobs_and_entropy(logits, targets, temperature, with_entropy, kernel, reuse_logits=True)
        lp, ent = lp[0], (ent[0] if ent is not None else None)
    return packed.scatter(lp), (packed.scatter(ent) if ent is not None else None)
