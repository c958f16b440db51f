"""Temperature sampling with counter noise as two Triton kernels (GPU): one read of the logits per step.

`sample_tokens` on the torch path makes the float32 logits, a log-softmax, a softmax and the [B, V]
int64 noise tensor with some thirty elementwise kernels; at Qwen's 152k vocabulary that was the largest
cost of a decode step. Here each program takes one (row, vocab segment): it hashes the same counter
noise as `counter_exponential` (splitmix64 on int64, bit for bit), keeps a running log-sum-exp (rescaled
once per step of entries, one `exp` per entry) and the running best Gumbel score ``x - log(E)``, and
writes those four numbers; a second kernel combines the segments of each row into the token and its
log-prob. Plain temperature sampling only: top-k/top-p and greedy stay on the torch path.
"""

from __future__ import annotations

import torch

from hybridrl.engines.kernels import pdl

try:  # Triton ships with CUDA builds of torch; CPU wheels have none
    import triton
    import triton.language as tl

    from hybridrl.engines.kernels.pdl import await_inputs
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# Launch tuning from tools/bench_decode_kernels.py --what sampler (docs/measurements/h200_1201/r_kernels.json, H200,
# Qwen's 151,936 entries): at 64 and 256 rows, 8 segments of 1024-entry steps were the fastest of 8/16/32 ×
# 1024/2048/4096 × 4/8 warps (256 rows: 154 µs, against 181 at 16 × 2048). Below 64 rows, 16 segments keep more
# programs in flight (not measured there; the earlier default).
_BLOCK = 1024
_WARPS = 4


def segments_for(rows: int) -> int:
    """Vocabulary segments per row (one program each) for a batch of `rows`."""
    return 8 if rows >= 64 else 16


def fast_log(device: torch.device) -> bool:
    """Whether the kernel takes the GPU's approximate log (PTX: NVIDIA CUDA); the interpreter (tests on CPU) and ROCm
    run no PTX."""
    return device.type == "cuda" and torch.version.hip is None


def available(logits: torch.Tensor) -> bool:
    """Whether the fused kernels can sample these logits (CUDA tensor, Triton importable)."""
    from hybridrl.engines.kernels import ON_CPU  # tests: the interpreter on CPU tensors

    return triton is not None and (logits.is_cuda or ON_CPU)


if triton is not None:

    @triton.jit
    def _mix_head(x):
        # splitmix64's finalizer on int64 up to its last xor-shift; `>>` is arithmetic, so the masks make the shifts
        # logical. That last step (x ^ x >> 31) leaves bits 31..63 as they are.
        x = x ^ ((x >> 30) & 0x3FFFFFFFF)
        x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
        x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
        return x * -7723592293110705685  # 0x94D049BB133111EB as int64

    @triton.jit
    def _mix(x):
        # splitmix64's finalizer on int64.
        x = _mix_head(x)
        return x ^ ((x >> 31) & 0x1FFFFFFFF)

    @triton.jit
    def _ln(x, FAST: tl.constexpr):
        # log(x) by the GPU's lg2.approx (one instruction; absolute error ~2^-22 in log2 units, about float32's own
        # rounding of a log near 1), or libdevice's exact logf (~20 instructions) where inline PTX cannot run.
        if FAST:
            y = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                          pack=1)
            return y * 0.6931471805599453
        else:
            return tl.log(x)

    @triton.jit
    def _exponential(bits, FAST: tl.constexpr):
        # `sampling.exponential_from_bits`: E = -log(u), u = (k + 0.5) / 2^24, with u below 1/2 and w = 1 - u above
        # it (each exact in float32). Near u = 1, E is tiny and the approximate log's absolute error of 2^-22 would be
        # a large relative one: the winning draws come from exactly there (E small, score x - log(E) large), and
        # that log alone biased them. So where w < 2^-6, -log(1 - w) = w + w²/2 + ... in five terms (the next is
        # under w · 2^-32); above, 1 - w rounds by at most 2^-25, under 2e-6 of E there.
        upper = bits >= 8388608
        u = (bits.to(tl.float32) + 0.5) / 16777216.0
        w = ((16777215 - bits).to(tl.float32) + 0.5) / 16777216.0
        series = w * (1.0 + w * (0.5 + w * (0.3333333432674408 + w * (0.25 + w * 0.20000000298023224))))
        return tl.where(w < 0.015625, series, -_ln(tl.where(upper, 1.0 - w, u), FAST))

    @triton.jit
    def _segment_kernel(logits_ptr, stride, keys_ptr, steps_ptr, step_key, vocab, seg_len, temperature,
                        best_ptr, idx_ptr, max_ptr, sum_ptr, SEGMENTS: tl.constexpr, BLOCK: tl.constexpr,
                        SCALED: tl.constexpr, ROW_STEPS: tl.constexpr, FAST_LOG: tl.constexpr,
                        PDL: tl.constexpr):
        await_inputs(PDL)
        row = tl.program_id(0)
        seg = tl.program_id(1)
        if ROW_STEPS:  # `sampling.step_keys` of this row's own step, as `row_keys` makes it (products wrap)
            step_key = _mix((tl.load(steps_ptr + row) + 1) * -7046029254386353131)
        base = _mix(tl.load(keys_ptr + row) ^ step_key)
        lo = seg * seg_len
        hi = tl.minimum(lo + seg_len, vocab)
        lanes = tl.arange(0, BLOCK)
        # The counter's column term, cols · golden, as this block's start · golden plus a lane term fixed before the
        # loop (equal modulo 2^64): one int64 multiply per block instead of one per entry.
        lane_term = lanes.to(tl.int64) * -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
        col_term = lo.to(tl.int64) * -7046029254386353131
        block_term = tl.full((), BLOCK, tl.int64) * -7046029254386353131  # wraps, as the torch path's product does
        run_max = tl.full((), float("-inf"), tl.float32)
        run_sum = tl.zeros((), tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int32)
        for start in range(lo, hi, BLOCK):
            cols = start + lanes
            inside = cols < hi
            x = tl.load(logits_ptr + row * stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
            if SCALED:  # temperature 1 divides by nothing: x / 1.0 is x, bit for bit
                x = x / temperature
            # Log-sum-exp rescaled once per block (one exp per entry, not two: the per-lane running form
            # needs a second to rescale every lane).
            new_max = tl.maximum(run_max, tl.max(x, axis=0))
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(x - safe), axis=0)
            run_max = new_max
            # The noise of `counter_exponential`: Exp(1) from the top 24 bits of splitmix64; score = x - log(E).
            # Only bits 40..63 are kept, which splitmix64's last step leaves unchanged: `_mix_head` suffices.
            h = _mix_head(base + col_term + lane_term)
            col_term += block_term
            bits = (h >> 40) & 0xFFFFFF
            score = tl.where(inside, x - _ln(_exponential(bits, FAST_LOG), FAST_LOG), float("-inf"))
            better = score > best  # strict: the first (lowest) column wins a tie, like argmax
            best = tl.where(better, score, best)
            best_idx = tl.where(better, cols, best_idx)
        seg_best = tl.max(best, axis=0)
        # Lowest column among lanes holding the segment's best score.
        seg_idx = tl.min(tl.where(best == seg_best, best_idx, vocab), axis=0)
        out = row * SEGMENTS + seg
        tl.store(best_ptr + out, seg_best)
        tl.store(idx_ptr + out, seg_idx.to(tl.int64))
        tl.store(max_ptr + out, run_max)
        tl.store(sum_ptr + out, run_sum)

    @triton.jit
    def _combine_kernel(logits_ptr, stride, temperature, best_ptr, idx_ptr, max_ptr, sum_ptr,
                        tok_ptr, lp_ptr, SEGMENTS: tl.constexpr, PDL: tl.constexpr):
        await_inputs(PDL)
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


def sample_counter(logits: torch.Tensor, temperature: float, keys: torch.Tensor, step_key: int,
                   segments: int | None = None, block: int = _BLOCK, warps: int = _WARPS,
                   steps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] (int64) and their log-probs [B] (float32) for `logits` [B, V] (any float dtype; rows
    may be a strided view), drawn with the counter noise of (keys, step_key); with `steps` [B] (int64), of
    `row_keys(keys, steps)` instead, each row's step key made inside the kernel (`step_key` is then ignored).
    See the module doc. `segments` per row (a power of two; default `segments_for`), `block` entries per step and
    `warps` per program: launch tuning only."""
    rows, vocab = logits.shape
    segments = segments or segments_for(rows)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    seg_len = -(-vocab // segments)
    parts = torch.empty(4, rows, segments, dtype=torch.float32, device=dev)
    idx = torch.empty(rows, segments, dtype=torch.int64, device=dev)
    row_steps = steps is not None
    _segment_kernel[(rows, segments)](
        logits, logits.stride(0), keys, steps.to(torch.int64).contiguous() if row_steps else keys, 0 if row_steps else step_key,
        vocab, seg_len, float(temperature), parts[0], idx, parts[1], parts[2], SEGMENTS=segments, BLOCK=block,
        SCALED=temperature != 1.0, ROW_STEPS=row_steps, FAST_LOG=fast_log(dev), num_warps=warps,
        **pdl.launch(logits),
    )
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    _combine_kernel[(rows,)](logits, logits.stride(0), float(temperature), parts[0], idx, parts[1], parts[2],
                             tokens, logprobs, SEGMENTS=segments, **pdl.launch(logits))
    return tokens, logprobs
