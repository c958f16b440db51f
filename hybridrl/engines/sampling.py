"""Batched next-token sampling with the log-prob definition shared by trainer and engines."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hybridrl.engines.native.kernels import sampling as sampling_kernel
from hybridrl.engines.native.kernels.sampling import PICK_BLOCK
from hybridrl.errors import DivergenceError

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
    """`step_key` of each entry of an int64 tensor of step indices (the same numbers: int64 products wrap mod 2**64)."""
    return _mix((steps + 1) * _GOLDEN)


def row_keys(keys: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """Each row's key for this step, ``keys ^ step_key(step)``: `step` is one index for all rows, or one per row
    (rows of a continuous batch are at different steps)."""
    return keys ^ (step_key(step) if isinstance(step, int) else step_keys(step))


def counter_uniform(keys: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """One uniform draw per row in (0, 1), float64, that is a pure function of (key, step): u = (k + 0.5) / 2^52 for
    k the top 52 bits of splitmix64 of the row's key for this step (`row_keys`); `step` an int or one index per row.

    Counter-based, like Philox: a row's draw never depends on which other rows share the batch, so sampling is
    reproducible across worker counts, chunking and finished-row removal. `sampling_kernel` makes the same bits
    inside its kernel."""
    bits = (_mix(row_keys(keys, step)) >> 12) & ((1 << 52) - 1)
    return (bits.to(torch.float64) + 0.5) / float(1 << 52)


def inverse_cdf(scaled: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token [B] (int64) whose interval of the row's cumulative distribution holds u [B] (float64 in [0, 1)), over
    the softmax of `scaled` [B, V] (float32; -inf entries are never drawn): inverse-transform sampling, as FlashInfer's
    samplers do, in two levels so that one uniform per row suffices and the fused kernel reads the logits once.

    The row is cut into blocks of `PICK_BLOCK` entries; each block's weight is its max m_b and sum s_b of exp(x - m_b)
    (float32), rescaled to the row's max; u · (sum of the weights) picks a block in float64, and the fraction of that
    block's weight left over picks the entry by a float64 running sum of the block's float32 exp(x - m_b). Entry i of
    block b is drawn with probability w_b / W · e_i / Σe = softmax_i up to float32 rounding of the terms (relative
    1e-7). The two levels keep a 152k-entry running sum out of the search (in float32, a flat row's would be spaced
    ~1.5% of one entry's weight), and the fused kernel, whose block sums add the same terms in another order, draws
    the same entry unless u falls within that rounding of an interval's end.

    Whatever the logits, the token is an index into the row: a row of NaN or +inf (a diverged policy) draws some
    in-range token rather than an out-of-bounds one, and its log-prob (NaN) tells the caller."""
    rows, vocab = scaled.shape
    nb = -(-vocab // PICK_BLOCK)
    x = F.pad(scaled, (0, nb * PICK_BLOCK - vocab), value=float("-inf")).view(rows, nb, PICK_BLOCK)
    m = x.amax(-1)
    s = torch.exp(x - torch.where(m == float("-inf"), 0.0, m)[..., None]).sum(-1)
    w = (s * torch.exp(m - m.amax(-1, keepdim=True))).double()  # a block of -inf only: 0 · 0
    c = w.cumsum(-1)
    target = u * c[:, -1]
    blocks = torch.arange(nb, device=x.device)
    # The first block whose running total passes the target; rounding can leave none (target ≈ total): the last
    # block of any weight then.
    # Clamped at 0: a row with no weight at all (NaN or inf logits) draws an in-range token; its log-prob is not
    # finite, which the engines and the controller report as a DivergenceError.
    j = torch.minimum((c <= target[:, None]).sum(-1), torch.where(w > 0, blocks, -1).amax(-1)).clamp(min=0)
    wj = w.gather(1, j[:, None]).squeeze(1)
    frac = (target - (c.gather(1, j[:, None]).squeeze(1) - wj)) / wj
    xb = x[torch.arange(rows, device=x.device), j]
    e = torch.exp(xb - m.gather(1, j[:, None]))
    cum = e.double().cumsum(-1)
    rem = frac * cum[:, -1]
    lanes = torch.arange(PICK_BLOCK, device=x.device)
    i = torch.minimum((cum <= rem[:, None]).sum(-1), torch.where(e > 0, lanes, -1).amax(-1)).clamp(min=0)
    return (j * PICK_BLOCK + i).clamp(max=vocab - 1)


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
    key per row) the row's uniform comes from `counter_uniform(keys, step)` (`step` one index, or one per row),
    else from `generator`; the draw is `inverse_cdf` of the (top-k/top-p filtered) softmax;
    `kernel` lets such rows go to the fused GPU kernel (`sampling_kernel`) when top-k/top-p are off.

    Non-finite logits never index out of range: the token is some valid id and its log-prob is not finite.
    `check_finite_logprobs` turns that into a DivergenceError where the log-probs reach the host.
    """
    if temperature == 0:
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    if kernel and keys is not None and top_k <= 0 and top_p >= 1.0 and sampling_kernel.available(logits):
        if isinstance(step, int):
            return sampling_kernel.sample_counter(logits, temperature, keys, step_key(step))
        return sampling_kernel.sample_counter(logits, temperature, keys, 0, steps=step)  # row_keys in the kernel
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
    if keys is not None:
        u = counter_uniform(keys, step)
    else:
        u = torch.rand(scaled.shape[0], dtype=torch.float64, device=scaled.device, generator=generator)
    tokens = inverse_cdf(filtered, u)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def check_finite_logprobs(logprobs: Sequence[float], where: str) -> None:
    """DivergenceError when a sampled token's log-prob is NaN or inf: the logits it was drawn from were not finite
    (or so large that the softmax overflowed), which a usable policy never produces. `where` names the engine and
    the decode position for the message."""
    bad = sum(1 for x in logprobs if not math.isfinite(x))
    if bad:
        raise DivergenceError(
            f"{where}: {bad} of {len(logprobs)} rows drew from logits that are not finite (NaN or inf): the policy's "
            "weights have diverged or hold values the model cannot compute with. Lower trainer.lr and resume from "
            "the last checkpoint, or check model.path"
        )
