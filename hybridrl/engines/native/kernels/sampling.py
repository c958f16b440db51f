"""Temperature sampling by one counter uniform per row as two Triton kernels (GPU): one read of the logits per step.

The draw is `sampling.inverse_cdf` of the row's softmax at `sampling.counter_uniform(keys, step)`, the torch path's
definition, in two launches:

    stats: one program per (row, vocab segment): for each block of `PICK_BLOCK` entries of its segment, the block's
           max and its sum of exp(x - max) (one exp per entry: the pass is a read of the logits)
    pick:  one program per row: the row's uniform (splitmix64 of its key, bit for bit the torch path's), the blocks'
           weights and their float64 running sum, the block holding u · total; then that block's entries and their
           float32 running sum, the entry holding what is left; the log-prob from the same sums

Plain temperature sampling only: top-k/top-p and greedy stay on the torch path. The two paths round differently (the
kernel's exp is the GPU's approximate one, its sums go in another order), so a draw can differ where u falls within
that rounding of an interval's end: emulated on CPU (exp as 2^(x·log2 e), sums reversed) over 8192 rows of randn·3
logits at 152k entries, 4 draws differed, each to a neighbouring entry, all of probability under 1e-6. Error in the
block weights (relative ~1e-6) moves the point within the block by that much of the whole row's mass.

Why not the exponential race (argmax of x - log E, E ~ Exp(1) per entry): it hashes and takes two logs per entry,
~60 instructions an entry, and is issue-bound: 97.4 µs for 256 rows of Qwen's 152k entries on the H200, where reading
the bf16 logits takes ~16 µs; these kernels take 27.6 µs there.
"""

from __future__ import annotations

import torch

from hybridrl.engines.native.kernels import pdl

try:  # Triton ships with CUDA builds of torch; CPU wheels have none
    import triton
    import triton.language as tl

    from hybridrl.engines.native.kernels.pdl import await_inputs
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# Entries per block of the two-level CDF search (`sampling.inverse_cdf`): the kernels and the torch path cut each row
# the same way.
PICK_BLOCK = 1024

# Launch tuning (`python -m benchmarks.kernels --what sampler`; H200, Qwen's 151,936 entries, bf16 logits; the
# fastest of 4/8/16/32 segments × 1/2/4 blocks per step × 4/8 warps): 256 rows, 16 × 2 × 4: 27.6 µs (the exponential
# race: 96.9); 64 rows, 32 × 2 × 4: 11.2 µs (the race: 28.4).
_SUB = 2
_WARPS = 4


def segments_for(rows: int) -> int:
    """Vocabulary segments per row (one stats program each) for a batch of `rows`: 16 from 128 rows, else 32."""
    return 16 if rows >= 128 else 32


def fast_log(device: torch.device) -> bool:
    """Whether the kernel takes the GPU's approximate exp without subnormal fix-ups (PTX: NVIDIA CUDA); the
    interpreter (tests on CPU) and ROCm run no PTX."""
    return device.type == "cuda" and torch.version.hip is None


def available(logits: torch.Tensor) -> bool:
    """Whether the fused kernels can sample these logits (CUDA tensor, Triton importable)."""
    from hybridrl.engines.native.kernels import ON_CPU  # tests: the interpreter on CPU tensors

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
    def _exp(x, FAST: tl.constexpr):
        # exp(x) as tl.exp makes it (ex2.approx of x·log2 e) but flushing subnormal results to 0, which drops the
        # fix-up instructions; here those are terms under 2^-126 of a sum that is at least 1, so no sum changes.
        if FAST:
            return tl.inline_asm_elementwise(
                "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * 1.4426950408889634], dtype=tl.float32, is_pure=True, pack=1
            )
        else:
            return tl.exp(x)

    @triton.jit
    def _stats_kernel(
        logits_ptr,
        stride,
        vocab,
        n_blocks,
        seg_blocks,
        temperature,
        max_ptr,
        sum_ptr,
        PICK: tl.constexpr,
        SUB: tl.constexpr,
        SCALED: tl.constexpr,
        FAST: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * seg_blocks
        last = tl.minimum(first + seg_blocks, n_blocks)
        sub = tl.arange(0, SUB)
        lanes = tl.arange(0, PICK)
        for start in range(first, last, SUB):
            blk = start + sub
            mine = blk < last
            cols = blk[:, None] * PICK + lanes[None, :]
            x = tl.load(logits_ptr + row * stride + cols, mask=mine[:, None] & (cols < vocab), other=float("-inf")).to(
                tl.float32
            )
            if SCALED:  # temperature 1 divides by nothing: x / 1.0 is x, bit for bit
                x = x / temperature
            m = tl.max(x, axis=1)
            s = tl.sum(_exp(x - tl.where(m == float("-inf"), 0.0, m)[:, None], FAST), axis=1)
            tl.store(max_ptr + row * n_blocks + blk, m, mask=mine)
            tl.store(sum_ptr + row * n_blocks + blk, s, mask=mine)

    @triton.jit
    def _pick_kernel(
        logits_ptr,
        stride,
        vocab,
        n_blocks,
        temperature,
        max_ptr,
        sum_ptr,
        keys_ptr,
        steps_ptr,
        step_key,
        tok_ptr,
        lp_ptr,
        PICK: tl.constexpr,
        NBP: tl.constexpr,
        SCALED: tl.constexpr,
        ROW_STEPS: tl.constexpr,
        FAST: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        if ROW_STEPS:  # `sampling.step_keys` of this row's own step, as `row_keys` makes it (products wrap)
            step_key = _mix((tl.load(steps_ptr + row) + 1) * -7046029254386353131)  # 0x9E3779B97F4A7C15 as int64
        bits = (_mix(tl.load(keys_ptr + row) ^ step_key) >> 12) & 0xFFFFFFFFFFFFF  # `counter_uniform`'s 52 bits
        u = (bits.to(tl.float64) + 0.5) * 2.220446049250313e-16  # / 2^52
        # `sampling.inverse_cdf`, step by step.
        b = tl.arange(0, NBP)
        m = tl.load(max_ptr + row * n_blocks + b, mask=b < n_blocks, other=float("-inf"))
        s = tl.load(sum_ptr + row * n_blocks + b, mask=b < n_blocks, other=0.0)
        top = tl.max(m, axis=0)
        w = (s * tl.exp(m - top)).to(tl.float64)
        c = tl.cumsum(w, axis=0)
        total = tl.max(c, axis=0)
        target = u * total
        j = tl.minimum(tl.sum((c <= target).to(tl.int32), axis=0), tl.max(tl.where(w > 0, b, -1), axis=0))
        wj = tl.sum(tl.where(b == j, w, 0.0), axis=0)
        frac = (target - (tl.sum(tl.where(b == j, c, 0.0), axis=0) - wj)) / wj
        mj = tl.max(tl.where(b == j, m, float("-inf")), axis=0)
        lanes = tl.arange(0, PICK)
        cols = j * PICK + lanes
        x = tl.load(logits_ptr + row * stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        if SCALED:
            x = x / temperature
        e = _exp(x - mj, FAST)
        cum = tl.cumsum(e.to(tl.float64), axis=0)
        rem = frac * tl.max(cum, axis=0)
        i = tl.minimum(tl.sum((cum <= rem).to(tl.int32), axis=0), tl.max(tl.where(e > 0, lanes, -1), axis=0))
        lse = top + tl.log(total).to(tl.float32)
        tl.store(tok_ptr + row, (j * PICK + i).to(tl.int64))
        tl.store(lp_ptr + row, tl.sum(tl.where(lanes == i, x, 0.0), axis=0) - lse)


def sample_counter(
    logits: torch.Tensor,
    temperature: float,
    keys: torch.Tensor,
    step_key: int,
    segments: int | None = None,
    sub: int | None = None,
    warps: int = _WARPS,
    steps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] (int64) and their log-probs [B] (float32) for `logits` [B, V] (any float dtype; rows may be a strided
    view), drawn at the counter uniform of (keys, step_key); with `steps` [B] (int64), of `row_keys(keys, steps)`
    instead, each row's step key made inside the kernel (`step_key` is then ignored). See the module doc. `segments`
    per row (default `segments_for`), `sub` blocks per step of a stats program's loop (a power of two; default 1) and
    `warps` per stats program: launch tuning only, the same sums."""
    rows, vocab = logits.shape
    segments = segments or segments_for(rows)
    sub = sub or _SUB
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    n_blocks = -(-vocab // PICK_BLOCK)
    stats = torch.empty(2, rows, n_blocks, dtype=torch.float32, device=dev)
    scaled, fast = temperature != 1.0, fast_log(dev)
    _stats_kernel[(rows, segments)](
        logits,
        logits.stride(0),
        vocab,
        n_blocks,
        -(-n_blocks // segments),
        float(temperature),
        stats[0],
        stats[1],
        PICK=PICK_BLOCK,
        SUB=sub,
        SCALED=scaled,
        FAST=fast,
        num_warps=warps,
        **pdl.launch(logits),
    )
    row_steps = steps is not None
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    _pick_kernel[(rows,)](
        logits,
        logits.stride(0),
        vocab,
        n_blocks,
        float(temperature),
        stats[0],
        stats[1],
        keys,
        steps.to(torch.int64).contiguous() if row_steps else keys,
        0 if row_steps else step_key,
        tokens,
        logprobs,
        PICK=PICK_BLOCK,
        NBP=max(2, triton.next_power_of_2(n_blocks)),
        SCALED=scaled,
        ROW_STEPS=row_steps,
        FAST=fast,
        num_warps=4,
        **pdl.launch(logits),
    )
    return tokens, logprobs
