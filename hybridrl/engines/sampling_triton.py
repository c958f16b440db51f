"""Temperature sampling with counter noise as two Triton kernels (GPU): one read of the logits per step.

`sample_tokens` on the torch path makes the float32 logits, a log-softmax, a softmax and the [B, V]
int64 noise tensor with some thirty elementwise kernels; at Qwen's 152k vocabulary that was the largest
cost of a decode step. Here each program takes one (row, vocab segment): it hashes the same counter
noise as `counter_exponential` (splitmix64 on int64, bit for bit), keeps a running log-sum-exp (rescaled
once per step of entries, one `exp` per entry) and the running best Gumbel score ``x - log(E)``, and
writes those four numbers; a second kernel combines the segments of each row into the token and its
log-prob. Plain temperature sampling only: top-k/top-p and greedy stay on the torch path.

The loop is issue-bound (every entry's hash, noise and log-sum-exp term; ~60 instructions an entry in the sm_90 SASS),
so instructions are what it saves: the uniform is made from the hash's bits without an integer-to-float conversion,
and the logs and the exponential are the GPU's approximate ones without the subnormal fix-ups, where no input or kept
result is subnormal (`_ln`, `_exp`, `_exponential`). On the H200 at 256 rows: 154 → 115 (approximate logs) → 97.4 µs
(docs/measurements/h200_1202_s9/d_sampler.json: the same tokens and log-probs as the previous kernel, bit for bit).
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

# Launch tuning from tools/bench_decode_kernels.py --what sampler (H200, Qwen's 151,936 entries, the fastest of
# 8/16/32 segments × 1024/2048/4096-entry steps × 4/8 warps). 256 rows: 8 × 1024 (97.4 µs, against 103.4 at 8 × 2048;
# docs/measurements/h200_1202_s9/d_sampler.json). 64 rows: 8 × 2048 since the kernel lost its integer-to-float
# conversions (28.7 µs, against 38.5 at 8 × 1024; the same run); 8 × 1024 before it (h200_1201/r_kernels.json).
# Below 64 rows, 16 segments keep more programs in flight (not measured there; the earlier default).
_BLOCK = 1024
_WARPS = 4


def segments_for(rows: int) -> int:
    """Vocabulary segments per row (one program each) for a batch of `rows`."""
    return 8 if rows >= 64 else 16


def block_for(rows: int) -> int:
    """Entries per step of a program's loop for a batch of `rows`: 2048 where measured faster (64 rows), else 1024."""
    return 2048 if 64 <= rows < 128 else _BLOCK


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
        # rounding of a log near 1), or libdevice's exact logf (~20 instructions) where inline PTX cannot run. `.ftz`
        # drops the subnormal-input fix-up (three instructions): every input here is a normal float.
        if FAST:
            y = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                          pack=1)
            return y * 0.6931471805599453
        else:
            return tl.log(x)

    @triton.jit
    def _exp(x, FAST: tl.constexpr):
        # exp(x) as tl.exp makes it (ex2.approx of x·log2 e) but flushing subnormal results to 0, which drops the
        # fix-up instructions; here those are terms under 2^-126 of a sum that is at least 1, so no sum changes.
        if FAST:
            return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * 1.4426950408889634],
                                             dtype=tl.float32, is_pure=True, pack=1)
        else:
            return tl.exp(x)

    @triton.jit
    def _exponential(h, FAST: tl.constexpr):
        # `sampling.exponential_from_bits` of k = the top 24 bits of h: E = -log(u), u = (k + 0.5) / 2^24, with u
        # below 1/2 and w = 1 - u above it (each exact in float32). Near u = 1, E is tiny and the approximate log's
        # absolute error of 2^-22 would be a large relative one: the winning draws come from exactly there (E small,
        # score x - log(E) large), and that log alone biased them. So where w < 2^-6, -log(1 - w) = w + w²/2 + ... in
        # five terms (the next is under w · 2^-32); above, 1 - w rounds by at most 2^-25, under 2e-6 of E there.
        # No integer-to-float conversion (a 64-bit one is several slow instructions): k's low 23 bits m go under
        # float32 1.0's exponent, f = 1 + m / 2^23 exactly, and t = (f - 1) / 2 + 2^-25 = (m + 0.5) / 2^24 is exact
        # (an odd multiple of 2^-25 below 1/2: 24 significant bits). Below 1/2, u = t; above, u = 1/2 + t, so
        # w = 1/2 - t (exact) and 1 - w = t + 1/2 rounded once: the same values as before.
        hi = (h >> 32).to(tl.int32)
        upper = hi < 0  # k's top bit: k >= 2^23
        t = ((((hi >> 8) & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0) * 0.5 + 2.98023223876953125e-08
        w = 0.5 - t
        series = w * (1.0 + w * (0.5 + w * (0.3333333432674408 + w * (0.25 + w * 0.20000000298023224))))
        return tl.where(upper & (w < 0.015625), series, -_ln(t + tl.where(upper, 0.5, 0.0), FAST))

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
            run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(_exp(x - safe, FAST_LOG), axis=0)
            run_max = new_max
            # The noise of `counter_exponential`: Exp(1) from the top 24 bits of splitmix64; score = x - log(E).
            # Only bits 40..63 are kept, which splitmix64's last step leaves unchanged: `_mix_head` suffices.
            h = _mix_head(base + col_term + lane_term)
            col_term += block_term
            score = tl.where(inside, x - _ln(_exponential(h, FAST_LOG), FAST_LOG), float("-inf"))
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
                   segments: int | None = None, block: int | None = None, warps: int = _WARPS,
                   steps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] (int64) and their log-probs [B] (float32) for `logits` [B, V] (any float dtype; rows
    may be a strided view), drawn with the counter noise of (keys, step_key); with `steps` [B] (int64), of
    `row_keys(keys, steps)` instead, each row's step key made inside the kernel (`step_key` is then ignored).
    See the module doc. `segments` per row (a power of two; default `segments_for`), `block` entries per step (default
    `block_for`) and `warps` per program: launch tuning only."""
    rows, vocab = logits.shape
    segments = segments or segments_for(rows)
    block = block or block_for(rows)
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
