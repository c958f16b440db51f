"""Temperature sampling with counter noise as two Triton kernels (GPU): one read of the logits per step.

`sample_tokens` on the torch path makes the float32 logits, a log-softmax, a softmax and the [B, V]
int64 noise tensor with some thirty elementwise kernels; at Qwen's 152k vocabulary that was the largest
cost of a decode step. Here each program takes one (row, vocab segment): it hashes the same counter
noise as `counter_exponential` (splitmix64 on int64, bit for bit), keeps a running log-sum-exp and the
running best Gumbel score ``x - log(E)``, and writes those four numbers; a second kernel combines the
segments of each row into the token and its log-prob. Plain temperature sampling only: top-k/top-p and
greedy stay on the torch path.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU wheels have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

_SEGMENTS = 16  # vocab segments per row: B × 16 programs keep every SM busy at decode batch sizes
_BLOCK = 2048


def available(logits: torch.Tensor) -> bool:
    """Whether the fused kernels can sample these logits (CUDA tensor, Triton importable)."""
    from hybridrl.engines.kernels import ON_CPU  # tests: the interpreter on CPU tensors

    return triton is not None and (logits.is_cuda or ON_CPU)


if triton is not None:

    @triton.jit
    def _mix(x):
        # splitmix64's finalizer on int64; `>>` is arithmetic, so the masks make the shifts logical.
        x = x ^ ((x >> 30) & 0x3FFFFFFFF)
        x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
        x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
        x = x * -7723592293110705685  # 0x94D049BB133111EB as int64
        return x ^ ((x >> 31) & 0x1FFFFFFFF)

    @triton.jit
    def _segment_kernel(logits_ptr, stride, keys_ptr, step_key, vocab, seg_len, temperature,
                        best_ptr, idx_ptr, max_ptr, sum_ptr, SEGMENTS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        seg = tl.program_id(1)
        base = _mix(tl.load(keys_ptr + row) ^ step_key)
        lo = seg * seg_len
        hi = tl.minimum(lo + seg_len, vocab)
        run_max = tl.full([BLOCK], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int64)
        for start in range(lo, hi, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < hi
            x = tl.load(logits_ptr + row * stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
            x = x / temperature
            # Online log-sum-exp per lane (merged across lanes at the end).
            new_max = tl.maximum(run_max, x)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(x - safe)
            run_max = new_max
            # The noise of `counter_exponential`: Exp(1) from 24 hashed bits; score = x - log(E).
            h = _mix(base + cols.to(tl.int64) * -7046029254386353131)  # 0x9E3779B97F4A7C15 as int64
            bits = (h >> 40) & 0xFFFFFF
            u = (bits.to(tl.float32) + 0.5) / 16777216.0
            score = tl.where(inside, x - tl.log(-tl.log(u)), float("-inf"))
            better = score > best  # strict: the first (lowest) column wins a tie, like argmax
            best = tl.where(better, score, best)
            best_idx = tl.where(better, cols.to(tl.int64), best_idx)
        seg_best = tl.max(best, axis=0)
        # Lowest column among lanes holding the segment's best score.
        seg_idx = tl.min(tl.where(best == seg_best, best_idx, vocab), axis=0)
        seg_max = tl.max(run_max, axis=0)
        safe_max = tl.where(seg_max == float("-inf"), 0.0, seg_max)
        seg_sum = tl.sum(run_sum * tl.exp(run_max - safe_max), axis=0)
        out = row * SEGMENTS + seg
        tl.store(best_ptr + out, seg_best)
        tl.store(idx_ptr + out, seg_idx)
        tl.store(max_ptr + out, seg_max)
        tl.store(sum_ptr + out, seg_sum)

    @triton.jit
    def _combine_kernel(logits_ptr, stride, temperature, best_ptr, idx_ptr, max_ptr, sum_ptr,
                        tok_ptr, lp_ptr, SEGMENTS: tl.constexpr):
        row = tl.program_id(0)
        offs = row * SEGMENTS + tl.arange(0, SEGMENTS)
        best = tl.load(best_ptr + offs)
        idx = tl.load(idx_ptr + offs)
        m = tl.load(max_ptr + offs)
        s = tl.load(sum_ptr + offs)
        top = tl.max(best, axis=0)
        tok = tl.min(tl.where(best == top, idx, 2**62), axis=0)
        gmax = tl.max(m, axis=0)
        lse = gmax + tl.log(tl.sum(s * tl.exp(m - gmax), axis=0))
        x = tl.load(logits_ptr + row * stride + tok).to(tl.float32) / temperature
        tl.store(tok_ptr + row, tok)
        tl.store(lp_ptr + row, x - lse)


def sample_counter(logits: torch.Tensor, temperature: float, keys: torch.Tensor,
                   step_key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] (int64) and their log-probs [B] (float32) for `logits` [B, V] (any float dtype; rows
    may be a strided view), drawn with the counter noise of (keys, step_key). See the module doc."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    seg_len = -(-vocab // _SEGMENTS)
    parts = torch.empty(4, rows, _SEGMENTS, dtype=torch.float32, device=dev)
    idx = torch.empty(rows, _SEGMENTS, dtype=torch.int64, device=dev)
    _segment_kernel[(rows, _SEGMENTS)](
        logits, logits.stride(0), keys, step_key, vocab, seg_len, float(temperature),
        parts[0], idx, parts[1], parts[2], SEGMENTS=_SEGMENTS, BLOCK=_BLOCK,
    )
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    _combine_kernel[(rows,)](logits, logits.stride(0), float(temperature), parts[0], idx, parts[1], parts[2],
                             tokens, logprobs, SEGMENTS=_SEGMENTS)
    return tokens, logprobs
