"""Batched next-token sampling with the log-prob definition shared by trainer and engines."""

from __future__ import annotations

import torch

from hybridrl.engines import sampling_triton

_M1 = 0xBF58476D1CE4E5B9 - 2**64  # splitmix64 constants as signed int64
_M2 = 0x94D049BB133111EB - 2**64
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MASK64 = 2**64 - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (multiplication wraps; shifts made logical by masking)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def _mix_int(x: int) -> int:
    """splitmix64's finalizer on a Python int modulo 2**64 (same function as `_mix`)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * (_M1 & _MASK64)) & _MASK64
    x = ((x ^ (x >> 27)) * (_M2 & _MASK64)) & _MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """The random-stream key of one sample (a signed int64), from its seed and global position."""
    x = _mix_int(_mix_int(seed * 1_000_003 + prompt_index) + sample_index * (_GOLDEN & _MASK64))
    return x - 2**64 if x >= 2**63 else x


def step_key(step: int) -> int:
    """The signed int64 that a decode step's index contributes to every row's noise."""
    k = _mix_int((step + 1) * (_GOLDEN & _MASK64))
    return k - 2**64 if k >= 2**63 else k


def step_keys(steps: torch.Tensor) -> torch.Tensor:
    """`step_key` of every entry of an int64 tensor of step indices (the same numbers: int64 products wrap mod 2**64)."""
    return _mix((steps + 1) * _GOLDEN)


def row_keys(keys: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """Each row's key for this step, ``keys ^ step_key(step)``: `step` is one index for all rows, or one per row
    (rows of a continuous batch are at different steps)."""
    return keys ^ (step_key(step) if isinstance(step, int) else step_keys(step))


def counter_exponential(keys: torch.Tensor, step: int | torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [len(keys), vocab] that is a pure function of (key, step, token id); `step` an int or one
    index per row.

    Counter-based, like Philox: a row's noise never depends on which other rows share the batch,
    so sampling is reproducible across worker counts, chunking and finished-row removal.
    `sampling_triton` computes the same bits inside its kernel.
    """
    cols = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = _mix(row_keys(keys, step)[:, None]) + cols[None, :] * _GOLDEN
    return exponential_from_bits((_mix(x) >> 40) & ((1 << 24) - 1))


_HALF = 1 << 23


def exponential_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise in float32 from 24 uniform bits k: -log(u) at u = (k + 0.5) / 2^24, every value in (0, 17.33].

    u itself is exact in float32 only below 1/2: (k + 0.5) needs 25 significant bits from k = 2^23, and rounded there
    the top k gave u = 1 and E = 0, a score of +inf, so one token in 2^24 won whatever its probability (0.9% of
    draws at Qwen's 151,936 entries). From 1/2 up the noise is -log1p(-w) of the exact w = 1 - u instead. The fused
    kernel computes the same numbers (`sampling_triton`)."""
    upper = bits >= _HALF
    u = (bits.to(torch.float32) + 0.5) / float(1 << 24)
    w = (((1 << 24) - 1 - bits).to(torch.float32) + 0.5) / float(1 << 24)
    return torch.where(upper, -torch.log1p(-w), -torch.log(u))


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    keys: torch.Tensor | None = None,
    step: int | torch.Tensor = 0,
    kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [B, V]; returns (tokens [B], logprobs [B]).

    The log-prob is log_softmax(logits / temperature) at the sampled token, taken before
    top-k/top-p filtering, so it equals what the trainer computes for the same token.
    temperature == 0 is greedy, with the log-prob at temperature 1. With `keys` (one int64 stream
    key per row) the noise comes from `counter_exponential(keys, step, V)` (`step` one index, or one per row),
    else from `generator`;
    `kernel` lets such rows go to the fused GPU kernel (`sampling_triton`) when top-k/top-p are off.
    """
    if temperature == 0:
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    if kernel and keys is not None and top_k <= 0 and top_p >= 1.0 and sampling_triton.available(logits):
        if isinstance(step, int):
            return sampling_triton.sample_counter(logits, temperature, keys, step_key(step))
        return sampling_triton.sample_counter(logits, temperature, keys, 0, steps=step)  # row_keys in the kernel
    scaled = logits.float() / temperature
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
    # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, without a CDF search; in logs,
    # argmax(filtered - log E) (the softmax's normalizer is the same for every column of a row).
    if keys is not None:
        noise = counter_exponential(keys, step, filtered.shape[-1])
    else:
        noise = torch.empty_like(filtered).exponential_(1.0, generator=generator)
    tokens = (filtered - noise.log()).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
