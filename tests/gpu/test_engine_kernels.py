"""The fused engine's decode kernels: the torch paths against independent references (transformers' own modules, a
per-sequence softmax over a contiguous cache), and the Triton kernels against the torch paths.

The Triton tests run on CUDA (`HYBRIDRL_TEST_DEVICE=cuda`, skipped without it) or, to check their logic on CPU,
under Triton's interpreter (triton installed): `TRITON_INTERPRET=1 python -m pytest tests/gpu/test_engine_kernels.py`.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

import tests.triton_interpret  # noqa: F401  (the interpreter's numpy fix, when it is on)
from hybridrl.engines.native.kernels import HAS_TRITON, attention, linear, norms, rope_cache, step_state

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and os.environ.get("HYBRIDRL_TEST_DEVICE", "cuda" if not INTERPRET else "") == "cuda"
TRITON_DEVICE = "cuda" if CUDA else ("cpu" if INTERPRET else None)
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or TRITON_DEVICE is None,
    reason="Triton kernels need CUDA, or TRITON_INTERPRET=1 with triton installed",
)
pytestmark = pytest.mark.interpreted  # every test: each is one kernel against its torch path
# float32 under the interpreter or on CUDA; bfloat16 only on CUDA (the interpreter's bf16 is numpy emulation).
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


def paged_cache(seqs: list[torch.Tensor], block_size: int, num_blocks: int, gen: torch.Generator):
    """Scatter per-sequence K (or V) [L_b, kv_heads, d] into a shuffled paged cache; returns (cache, block table)."""
    hkv, d = seqs[0].shape[1:]
    cache = torch.randn(num_blocks, hkv, block_size, d, generator=gen)  # garbage where nothing is stored
    free = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()  # block 0 stays scratch
    width = max(-(-len(s) // block_size) for s in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for b, s in enumerate(seqs):
        for j in range(-(-len(s) // block_size)):
            blk = free.pop()
            table[b, j] = blk
            chunk = s[j * block_size : (j + 1) * block_size]
            cache[blk, :, : len(chunk)] = chunk.transpose(0, 1)
    return cache, table


def naive_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float) -> torch.Tensor:
    """softmax(q·kᵀ·scale)·v per sequence and query head over contiguous K/V, in float64 (kv head = head // g)."""
    out = []
    hq, hkv = q.shape[1], ks[0].shape[1]
    for b in range(q.shape[0]):
        rows = []
        for h in range(hq):
            k, v = ks[b][:, h // (hq // hkv)].double(), vs[b][:, h // (hq // hkv)].double()
            w = torch.softmax(k @ q[b, h].double() * scale, dim=0)
            rows.append(w @ v)
        out.append(torch.stack(rows))
    return torch.stack(out)


def attention_case(lens, hq=14, hkv=2, d=64, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn(n, hkv, d, generator=gen) for n in lens]
    vs = [torch.randn(n, hkv, d, generator=gen) for n in lens]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    kc, table = paged_cache(ks, block_size, num_blocks, torch.Generator().manual_seed(seed + 1))
    vc, table_v = paged_cache(vs, block_size, num_blocks, torch.Generator().manual_seed(seed + 1))
    assert torch.equal(table, table_v)
    q = torch.randn(len(lens), hq, d, generator=gen)
    return q, ks, vs, kc, vc, table, torch.tensor(lens)


@pytest.mark.parametrize("hq,hkv,d,block_size", [(14, 2, 64, 16), (4, 4, 16, 4), (8, 1, 32, 32)])
def test_torch_decode_attention_matches_a_per_sequence_softmax(hq, hkv, d, block_size):
    lens = [1, 17, 40, 5]
    q, ks, vs, kc, vc, table, seq_lens = attention_case(lens, hq, hkv, d, block_size)
    got = attention.decode_attention_torch(q, kc, vc, table, seq_lens, max(lens), d**-0.5)  # the least width
    want = naive_attention(q, ks, vs, d**-0.5)
    assert (got.double() - want).abs().max().item() < 1e-5


def test_table_rows_let_queries_share_a_sequence():
    """Packed prompt tokens: several queries read one sequence's block table row, each up to its own length (its
    position + 1), as `FusedDecoder.extend` asks; each equals a softmax over that sequence's prefix."""
    lens = [1, 17, 40, 5]
    _, ks, vs, kc, vc, table, _ = attention_case(lens, 14, 2, 64, 16)
    rows, upto = [2, 2, 2, 1, 3, 2], [38, 39, 40, 17, 2, 1]
    q = torch.randn(len(rows), 14, 64, generator=torch.Generator().manual_seed(9))
    want = naive_attention(
        q, [ks[r][:n] for r, n in zip(rows, upto)], [vs[r][:n] for r, n in zip(rows, upto)], 64**-0.5
    )
    got = attention.decode_attention_torch(
        q, kc, vc, table, torch.tensor(upto), max(lens), 64**-0.5, torch.tensor(rows)
    )
    assert (got.double() - want).abs().max().item() < 1e-5
    if HAS_TRITON and TRITON_DEVICE is not None:  # the kernel too, where it runs
        dev = TRITON_DEVICE
        got = attention.decode_attention_triton(
            q.to(dev),
            kc.to(dev),
            vc.to(dev),
            table.to(dev),
            torch.tensor(upto, device=dev),
            64**-0.5,
            2,
            torch.tensor(rows, device=dev),
        )
        assert (got.double().cpu() - want).abs().max().item() < 1e-5


def test_rms_norms_match_transformers():
    gen = torch.Generator().manual_seed(0)
    x, delta = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    ref = Qwen2RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.3 * torch.randn(48, generator=gen))
        for dtype in (torch.float32, torch.bfloat16):
            r = ref.to(dtype)
            xs, ds = x.to(dtype), delta.to(dtype)
            assert torch.equal(norms.rms_norm_torch(xs, r.weight, 1e-6), r(xs))
            s, h = norms.add_rms_norm_torch(xs, ds, r.weight, 1e-6)
            assert torch.equal(s, xs + ds) and torch.equal(h, r(xs + ds))


def test_split_qkv_matches_transformers_rope_and_qk_norm():
    from hybridrl.engines.native.architectures import rope_tables
    from tests.tiny_models import tiny_config

    config = tiny_config("qwen3")
    hq, hkv, d, n = 4, 2, 16, 6
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen)
    pos = torch.tensor([0, 3, 7, 1, 30, 2])
    cos, sin = rope_tables(config, 32, torch.float32, torch.device("cpu"))
    sin_signed = torch.cat((-sin[:, : d // 2], sin[:, d // 2 :]), dim=-1)
    qn, kn = Qwen2RMSNorm(d, eps=1e-6), Qwen2RMSNorm(d, eps=1e-6)
    with torch.no_grad():
        qn.weight.copy_(1 + 0.3 * torch.randn(d, generator=gen))
        kn.weight.copy_(1 + 0.3 * torch.randn(d, generator=gen))
        q, k, v = rope_cache.split_qkv_torch(
            qkv, hq, hkv, cos[pos][:, None], sin_signed[pos][:, None], qn.weight, kn.weight, 1e-6
        )
        x = qkv.view(n, hq + 2 * hkv, d)
        # transformers: [batch, heads, seq, d] with cos/sin [batch, seq, d]; one sequence of n tokens here.
        q_ref, k_ref = apply_rotary_pos_emb(
            qn(x[:, :hq]).transpose(0, 1)[None],
            kn(x[:, hq : hq + hkv]).transpose(0, 1)[None],
            cos[pos][None],
            sin[pos][None],
        )
    assert (q - q_ref[0].transpose(0, 1)).abs().max() < 1e-6
    assert (k - k_ref[0].transpose(0, 1)).abs().max() < 1e-6
    assert torch.equal(v, x[:, hq + hkv :])


def test_write_kv_places_each_token_at_its_slot():
    kc, vc = torch.zeros(4, 2, 8, 3), torch.zeros(4, 2, 8, 3)
    k, v = torch.randn(3, 2, 3), torch.randn(3, 2, 3)
    slots = torch.tensor([8 * 2 + 5, 8 * 1 + 0, 8 * 3 + 7])
    rope_cache.write_kv_torch(kc, vc, slots, k, v)
    assert torch.equal(kc[2, :, 5], k[0]) and torch.equal(kc[1, :, 0], k[1]) and torch.equal(vc[3, :, 7], v[2])
    assert int((kc != 0).any(-1).sum()) == 6  # 3 tokens × 2 heads, nothing else touched


# -- Triton against torch ------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hq,hkv,d,block_size,splits",
    [(14, 2, 64, 16, 1), (14, 2, 64, 16, 5), (4, 4, 16, 4, 3), (8, 1, 128, 32, 2), (16, 2, 64, 64, 7)],
)
def test_triton_decode_attention_matches_torch(dtype, hq, hkv, d, block_size, splits):
    lens = [1, 17, 40, 5, 130]
    q, _, _, kc, vc, table, seq_lens = attention_case(lens, hq, hkv, d, block_size, seed=3)
    dev = TRITON_DEVICE
    q, kc, vc, table, seq_lens = (t.to(dev) for t in (q.to(dtype), kc.to(dtype), vc.to(dtype), table, seq_lens))
    want = attention.decode_attention_torch(q, kc, vc, table, seq_lens, table.shape[1] * block_size, d**-0.5)
    got = attention.decode_attention_triton(q, kc, vc, table, seq_lens, d**-0.5, splits)
    assert got.dtype == dtype
    assert (got.float() - want.float()).abs().max().item() < _tol(dtype)


@needs_triton
@pytest.mark.parametrize("stages", [2, 3])
def test_triton_decode_attention_pipeline_depth_is_launch_tuning_only(stages):
    """Both depths `pipeline_stages` picks (2 where rows × kv heads outnumber the SMs) give the torch path's answer
    (the 1.5B's heads: 12 query heads on 2 kv heads of 128)."""
    dtype = DTYPES[-1]  # bfloat16 on CUDA; the interpreter has no bfloat16
    lens = [1, 17, 40, 5, 130]
    q, _, _, kc, vc, table, seq_lens = attention_case(lens, 12, 2, 128, 16, seed=4)
    dev = TRITON_DEVICE
    q, kc, vc, table, seq_lens = (t.to(dev) for t in (q.to(dtype), kc.to(dtype), vc.to(dtype), table, seq_lens))
    want = attention.decode_attention_torch(q, kc, vc, table, seq_lens, table.shape[1] * 16, 128**-0.5)
    got = attention.decode_attention_triton(q, kc, vc, table, seq_lens, 128**-0.5, 1, stages=stages)
    assert (got.float() - want.float()).abs().max().item() < _tol(dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_norms_match_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    x, delta = torch.randn(7, 96, generator=gen), torch.randn(7, 96, generator=gen)
    w = 1 + 0.3 * torch.randn(96, generator=gen)
    x, delta, w = (t.to(dtype).to(TRITON_DEVICE) for t in (x, delta, w))
    s_ref, h_ref = norms.add_rms_norm_torch(x, delta, w, 1e-6)
    s, h = norms.add_rms_norm_triton(x, delta, w, 1e-6)
    assert torch.equal(s, s_ref)
    assert (h.float() - h_ref.float()).abs().max().item() <= _tol(dtype) * 2
    _, plain = norms.add_rms_norm_triton(x, None, w, 1e-6)
    assert (plain.float() - norms.rms_norm_torch(x, w, 1e-6).float()).abs().max().item() <= _tol(dtype) * 2
    gu = torch.randn(5, 2 * 80, generator=gen).to(dtype).to(TRITON_DEVICE)
    assert (norms.silu_mul_triton(gu).float() - norms.silu_mul_torch(gu).float()).abs().max().item() <= _tol(dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("hq,heads", [(4, 8), (6, 4), (6, 1), (6, 16)])  # programs straddling q/k/v, and padded
def test_triton_rope_write_matches_torch(dtype, qk_norm, hq, heads):
    from hybridrl.engines.native.architectures import rope_tables
    from tests.tiny_models import tiny_config

    hkv, d, n, bs = 2, 16, 5, 4
    gen = torch.Generator().manual_seed(0)
    dev = TRITON_DEVICE
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(dev)
    cos, sin = rope_tables(tiny_config("qwen3"), 64, dtype, torch.device(dev))
    sin = torch.cat((-sin[:, : d // 2], sin[:, d // 2 :]), dim=-1)
    pos = torch.tensor([0, 9, 33, 4, 63], device=dev)
    slots = torch.tensor([5, 0, 13, 14, 31], device=dev)
    qn = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype).to(dev) if qk_norm else None
    kn = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype).to(dev) if qk_norm else None
    caches = [torch.zeros(8, hkv, bs, d, dtype=dtype, device=dev) for _ in range(4)]
    q_ref = rope_cache.rope_write_torch(qkv, hq, hkv, cos, sin, pos, slots, caches[0], caches[1], qn, kn, 1e-6)
    q = rope_cache.rope_write_triton(
        qkv, hq, hkv, cos, sin, pos, slots, caches[2], caches[3], qn, kn, 1e-6, heads=heads
    )
    # The same roundings in the same order, but rsqrt may differ by an ulp before them. Each output is
    # x·cos + swap(x)·sin: an ulp of either product can survive the sum, so the bound is an ulp (2^-7 in bf16) of
    # |x·cos| + |swap(x)·sin|, not of the result, which can cancel (seen on the H200: 0.03125 at a value of 4.56,
    # and beside it a small output off by more than its own ulp).
    x = qkv.float().view(n, hq + 2 * hkv, d)[:, : hq + hkv]
    if qk_norm:
        x = torch.cat(
            (
                x[:, :hq] * torch.rsqrt(x[:, :hq].pow(2).mean(-1, keepdim=True) + 1e-6) * qn.float(),
                x[:, hq:] * torch.rsqrt(x[:, hq:].pow(2).mean(-1, keepdim=True) + 1e-6) * kn.float(),
            ),
            dim=1,
        )
    mag = rope_cache.rope_torch(x.abs(), cos.float()[pos][:, None].abs(), sin.float()[pos][:, None].abs())
    ulp = 1e-6 if dtype == torch.float32 else 2**-7
    tol = 2 * ulp * mag + 1e-6  # rounding of the normed input, and of the products
    assert ((q.float() - q_ref.float()).abs() <= tol[:, :hq]).all()
    block, offset = slots // bs, slots % bs
    assert ((caches[2][block, :, offset].float() - caches[0][block, :, offset].float()).abs() <= tol[:, hq:]).all()
    assert torch.equal(caches[2].count_nonzero(), caches[0].count_nonzero())  # nothing written elsewhere
    assert torch.equal(caches[3], caches[1])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm,partials", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize(
    "hq,hkv,d,block_size,splits",
    [(12, 2, 64, 16, 1), (14, 2, 64, 16, 3), (4, 4, 16, 4, 3), (8, 1, 128, 32, 2), (32, 2, 16, 4, 2)],
)
def test_triton_rope_attention_matches_rope_write_then_attention(
    dtype, qk_norm, partials, hq, hkv, d, block_size, splits
):
    """The one-kernel decode attention against the torch path it stands for (rope_write_torch, then
    decode_attention_torch over positions ≤ each token's): the output, the k and v it stores, nothing else written.
    Sequences of 1 key (only the token's own), and of 17 at block 16 (its own key alone in the last block)."""
    from hybridrl.engines.native.architectures import rope_tables
    from hybridrl.engines.native.kernels import rope_attention
    from tests.tiny_models import tiny_config

    lens = [1, 17, 40, 5, 130]
    _, _, _, kc, vc, table, seq_lens = attention_case(lens, hq, hkv, d, block_size, seed=5)
    dev, n = TRITON_DEVICE, len(lens)
    gen = torch.Generator().manual_seed(6)
    width = (hq + 2 * hkv) * d
    qkv = torch.randn(3, n, width, generator=gen) / 2 if partials else torch.randn(n, width, generator=gen).to(dtype)
    config = tiny_config("qwen3")
    config.head_dim = d
    cos, sin = rope_tables(config, 160, dtype, torch.device(dev))
    sin = torch.cat((-sin[:, : d // 2], sin[:, d // 2 :]), dim=-1)
    qn = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype).to(dev) if qk_norm else None
    kn = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype).to(dev) if qk_norm else None
    pos = (seq_lens - 1).to(dev)
    table = table.to(dev)
    slots = table.long().gather(1, (pos // block_size)[:, None]).squeeze(1) * block_size + pos % block_size
    qkv, kc, vc = qkv.to(dev), kc.to(dtype).to(dev), vc.to(dtype).to(dev)
    k_ref, v_ref, k_got, v_got = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    scale = d**-0.5
    want = rope_attention.rope_attention_torch(
        qkv, hq, hkv, cos, sin, pos, slots, k_ref, v_ref, qn, kn, 1e-6, table, table.shape[1] * block_size, scale
    )
    got = rope_attention.rope_attention_triton(
        qkv, hq, hkv, cos, sin, pos, slots, k_got, v_got, qn, kn, 1e-6, table, scale, splits
    )
    assert got.dtype == dtype
    # k: RoPE's roundings in the same order (an ulp of rsqrt aside, as for rope_write); v: copied as it is.
    ulp = 1e-6 if dtype == torch.float32 else 2**-7
    assert ((k_got.float() - k_ref.float()).abs() <= 4 * ulp * k_ref.float().abs().amax() + 1e-6).all()
    assert torch.equal(v_got, v_ref)
    changed = (k_got != kc).flatten(1).any(1) | (k_ref != kc).flatten(1).any(1)
    assert set(changed.nonzero().flatten().tolist()) <= set((slots // block_size).tolist())  # only the tokens' blocks
    assert (got.float() - want.float()).abs().max().item() < 2 * _tol(dtype)


def test_prefix_groups_share_the_blocks_every_row_attends():
    """Hand-worked groupings: rows 0–2 begin with blocks 5, 6 (row 2 attends 40 positions: two whole blocks of 16),
    row 3 has no partner, row 4 attends less than a block; slots hold at most `members` rows."""
    from hybridrl.engines.native.kernels.shared_prefix import pack_prefix, prefix_groups

    tables = [[5, 6, 7, 9], [5, 6, 8, 10], [5, 6, 7, 11], [3, 4], [5, 13]]
    attended = [64, 64, 40, 64, 10]
    assert prefix_groups(tables, attended, 16, 8) == [([0, 1, 2], 2)]
    assert prefix_groups(tables, [64, 64, 64, 64, 10], 16, 8) == [([0, 1, 2], 2)]  # block 7 vs 8 at index 2
    assert prefix_groups(tables, [64, 20, 64, 64, 10], 16, 8) == [([0, 1, 2], 1)]  # row 1 attends one whole block
    assert prefix_groups(tables, [64, 64, 64, 64, 64], 16, 8) == [([0, 1, 2, 4], 1)]  # row 4 shares block 5 only
    assert prefix_groups(tables, attended, 16, 2) == [([0, 1], 2)]  # row 2 alone in the next slot: no slot
    assert prefix_groups([[1, 2], [3, 4]], [32, 32], 16, 8) == []
    # slots = 5 // 2 = 2, members 3: [0, 1, 2 | 2], [-1, -1, -1 | 0], then start per row
    assert pack_prefix([([0, 1, 2], 2)], 5, 3) == [0, 1, 2, 2, -1, -1, -1, 0, 2, 2, 2, 0, 0]


def shared_prefix_case(
    groups: list[tuple[int, int]], lens: list[int], hq: int, hkv: int, d: int, block_size: int, seed: int
):
    """A paged cache where each group (rows, prompt length) shares its prompt's full blocks, as GRPO samples do: the
    block tables point at the same blocks, whose K/V are the prompt's; K/V per row as contiguous tensors too."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    kc = torch.randn(num_blocks, hkv, block_size, d, generator=gen)
    vc = torch.randn(num_blocks, hkv, block_size, d, generator=gen)
    free = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()
    width = max(-(-n // block_size) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    row = 0
    for rows, prompt in groups:
        shared = [free.pop() for _ in range(prompt // block_size)]
        for r in range(row, row + rows):
            own = [free.pop() for _ in range(-(-lens[r] // block_size) - len(shared))]
            table[r, : len(shared) + len(own)] = torch.tensor(shared + own, dtype=torch.int32)
        row += rows
    ks = [
        kc[table[r, : -(-n // block_size)].long()].permute(0, 2, 1, 3).reshape(-1, hkv, d)[:n]
        for r, n in enumerate(lens)
    ]
    vs = [
        vc[table[r, : -(-n // block_size)].long()].permute(0, 2, 1, 3).reshape(-1, hkv, d)[:n]
        for r, n in enumerate(lens)
    ]
    q = torch.randn(len(lens), hq, d, generator=gen)
    return q, ks, vs, kc, vc, table, torch.tensor(lens)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,block_size", [(12, 2, 128, 16), (14, 2, 64, 16), (4, 4, 16, 4), (8, 1, 32, 32)])
def test_triton_shared_prefix_attention_matches_a_softmax_per_row(dtype, hq, hkv, d, block_size):
    """Groups of 3 rows over a 40-token prompt (two whole blocks of 16 shared, the partial third each row's own),
    a group larger than a slot, a group whose prompt is one block, and two rows alone: each row's output equals a
    float64 softmax over its own keys, and the torch path's."""
    from hybridrl.engines.native.kernels.shared_prefix import (
        SharedPrefix,
        pack_prefix,
        prefix_groups,
        shared_prefix_attention,
        slot_members,
    )

    p = 2 * block_size + block_size // 2
    groups = [(3, p), (5, 4 * block_size), (2, block_size), (1, p), (1, p)]
    lens = [
        p + 1,
        p + 9,
        p + 30,
        4 * block_size + 1,
        5 * block_size,
        4 * block_size + 3,
        6 * block_size + 2,
        4 * block_size + 7,
        block_size + 1,
        3 * block_size,
        p + 4,
        p + 5,
    ]
    q, ks, vs, kc, vc, table, seq_lens = shared_prefix_case(groups, lens, hq, hkv, d, block_size, seed=11)
    members = min(slot_members(hq, hkv), 3)  # 3 rows a slot: the group of 5 takes two slots
    found = prefix_groups(table.tolist(), lens, block_size, members)
    assert [(rows, n) for rows, n in found] == [([0, 1, 2], 2), ([3, 4, 5], 4), ([6, 7], 4), ([8, 9], 1)]
    packed = torch.tensor(pack_prefix(found, len(lens), members), dtype=torch.int32)
    n_slots = len(lens) // 2
    dev = TRITON_DEVICE
    prefix = SharedPrefix(
        packed[: n_slots * (members + 1)].view(n_slots, members + 1).to(dev), packed[n_slots * (members + 1) :].to(dev)
    )
    want = naive_attention(q, ks, vs, d**-0.5)
    q, kc, vc, table, seq_lens = (t.to(dev) for t in (q.to(dtype), kc.to(dtype), vc.to(dtype), table, seq_lens))
    ref = attention.decode_attention_torch(q, kc, vc, table, seq_lens, table.shape[1] * block_size, d**-0.5)
    got = shared_prefix_attention(q, kc, vc, table, seq_lens, d**-0.5, prefix)
    assert got.dtype == dtype
    assert (got.float() - ref.float()).abs().max().item() < _tol(dtype)
    if dtype == torch.float32:
        assert (got.double().cpu() - want).abs().max().item() < 1e-5


# The decode projections of the supported Qwen2.5 shapes (0.5B: hidden 896, 1.5B: 1536), per layer at TP 1: qkv,
# o_proj, gate_up, down_proj as (N, K).
PROJECTIONS = [
    (1152, 896),
    (896, 896),
    (9728, 896),
    (896, 4864),
    (2048, 1536),
    (1536, 1536),
    (17920, 1536),
    (1536, 8960),
]


def test_skinny_plans_are_valid_launches():
    """Every plan `skinny_plan` gives for a decode projection (1 to 64 rows, an H100/H200's 132 SMs or a smaller
    GPU's 46) is a launch the kernel takes: power-of-two K splits no finer than its 64-wide steps, supported tiles; no
    plan without SMs or rows, or past the skinny kernel's row and width limits."""
    for n, k in PROJECTIONS:
        for m in (1, 8, 33, 64):
            for sms in (46, 132):
                plan = linear.skinny_plan(m, n, k, sms)
                if plan is None:
                    assert n > linear.SKINNY_MAX_WIDTH
                    continue
                assert plan.splits in (1, 2, 4, 8) and plan.splits <= max(1, k // 64)
                assert plan.block_n in (32, 64) and plan.block_k in (64, 128)
        assert linear.skinny_plan(0, n, k, 132) is None and linear.skinny_plan(8, n, k, 0) is None
        assert linear.skinny_plan(linear.SKINNY_MAX_ROWS + 1, n, k, 132) is None


@needs_triton
@pytest.mark.parametrize("m,n,k", [(8, 1152, 896), (64, 896, 896), (64, 896, 4864), (33, 1536, 1536)])
def test_skinny_plans_compute_the_product(m, n, k):
    """The skinny kernel launched by its plan for a decode projection (float32 partials where it splits K) sums to the
    float64 product."""
    gen = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
    want = x.double() @ w.double().T
    plan = linear.skinny_plan(m, n, k, 132)
    assert plan is not None
    dev = TRITON_DEVICE
    got = linear.linear_triton(
        x.to(dev), w.to(dev), None, splits=plan.splits, block_n=plan.block_n, block_k=plan.block_k
    )
    got = linear.summed(got, torch.float32)
    assert got.shape == (m, n) and (got.double().cpu() - want).abs().max().item() < 1e-4


def test_batched_split_plans_give_aligned_slices():
    """Wherever `batched_splits` splits a projection, its K slices start on 16-byte boundaries of a half-precision
    row (what `linear_batched`'s strided views need) and the batch is past the skinny kernel's rows; a K that does not
    split so is never split."""
    for n, k in [*PROJECTIONS, (1536, 4100), (896, 4104)]:
        for m in (64, 65, 128, 256, 2048):
            splits = linear.batched_splits(m, n, k)
            if splits:
                assert k % splits == 0 and (k // splits) * 2 % 16 == 0
                assert linear.SKINNY_MAX_ROWS < m <= linear.BATCHED_MAX_ROWS
    assert linear.batched_splits(256, 1536, 4100) == 0


def test_batched_split_needs_a_bmm_with_float32_output():
    """The probe that guards it: the CPU has no kernel for bmm's float32 output, so `project` never takes the path
    there (nor on a torch without `out_dtype`); on CUDA with this torch it does."""
    assert linear.bmm_float_out(torch.device("cpu")) is False
    if CUDA:
        assert linear.bmm_float_out(torch.device("cuda")) is True


@pytest.mark.skipif(not CUDA, reason="torch.bmm with a float32 output runs on CUDA only")
def test_batched_split_matches_a_float64_product():
    gen = torch.Generator().manual_seed(0)
    m, n, k = 96, 72, 4096 + 512
    x, w = torch.randn(m, k, generator=gen).bfloat16(), (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    want = x.double() @ w.double().T
    got = linear.linear_batched(x.cuda(), w.cuda(), 4)
    assert got.dtype == torch.float32 and got.shape == (4, m, n)
    assert (got.double().sum(0).cpu() - want).abs().max().item() < 1e-4
    kc = k // 4
    third = x[:, 2 * kc : 3 * kc].double() @ w[:, 2 * kc : 3 * kc].double().T
    assert (got[2].double().cpu() - third).abs().max().item() < 1e-4
    # `project` takes this path for such a shape, and F.linear's for one with a bias.
    assert linear.project(x.cuda(), w.cuda(), None, 132).shape == (4, m, n)
    assert linear.project(x.cuda(), w.cuda(), torch.zeros(n, dtype=x.dtype, device="cuda"), 132).shape == (m, n)
    assert linear.project(x.cuda(), w.cuda(), None, 0).shape == (m, n)  # no SMs given: F.linear
    # Every decode projection the batched split takes sums to F.linear's product.
    for n, k in PROJECTIONS:
        for m in (128, 256):
            if linear.batched_splits(m, n, k):
                x, w = (
                    torch.randn(m, k, generator=gen).bfloat16(),
                    (torch.randn(n, k, generator=gen) / k**0.5).bfloat16(),
                )
                want = x.double() @ w.double().T
                got = linear.project(x.cuda(), w.cuda(), None, 132)
                assert got.dim() == 3 and (got.double().sum(0).cpu() - want).abs().max().item() < 1e-3


def test_project_is_f_linear_without_triton():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 8, generator=gen), torch.randn(5, 8, generator=gen), torch.randn(5, generator=gen)
    assert torch.equal(linear.project(x, w, b, 132, kernels=False), torch.nn.functional.linear(x, w, b))
    # A weight that is not dense rows (a transposed view) stays with F.linear, kernels or not.
    wt = torch.randn(8, 5, generator=gen).T
    assert torch.equal(linear.project(x, wt, None, 132), torch.nn.functional.linear(x, wt))
    parts = torch.randint(-8, 9, (3, 4, 5), generator=gen) / 4  # exact sums in any order
    assert torch.equal(linear.summed(parts, torch.float32), parts[0] + parts[1] + parts[2])
    finished = parts[0]
    assert linear.summed(finished, torch.bfloat16) is finished  # a finished projection passes through


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m,n,k,splits,bias",
    [(5, 40, 70, 1, True), (64, 96, 256, 1, False), (17, 33, 300, 3, True), (64, 128, 512, 8, False)],
)
def test_triton_linear_matches_a_float64_product(dtype, m, n, k, splits, bias):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    x, w = x.to(dtype), w.to(dtype)
    b = b.to(dtype) if bias else None
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    dev = TRITON_DEVICE
    got = linear.linear_triton(x.to(dev), w.to(dev), b.to(dev) if bias else None, splits=splits, block_n=32, block_k=64)
    if splits == 1:
        assert got.dtype == dtype and got.shape == (m, n)
        assert (got.double().cpu() - want).abs().max().item() <= 2**-7 * want.abs().max().item() + 1e-4
    else:  # float32 partials, one per stretch of K (whole 64-wide steps), the bias in the first
        per = -(-(-(-k // splits)) // 64) * 64
        assert got.dtype == torch.float32 and got.shape == (-(-k // per), m, n)
        assert (got.double().sum(0).cpu() - want).abs().max().item() < 1e-4
        first = x[:, :per].double() @ w[:, :per].double().T + (b.double() if bias else 0)
        assert (got[0].double().cpu() - first).abs().max().item() < 1e-4


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_consumers_sum_projection_partials(dtype):
    """add_rms_norm and rope_write take a projection's float32 partials: the same as the summed projection. The
    partials are multiples of 1/4 in [-2, 2], so every order of summing them is exact."""
    from hybridrl.engines.native.architectures import rope_tables
    from tests.tiny_models import tiny_config

    gen = torch.Generator().manual_seed(0)
    dev = TRITON_DEVICE
    parts = (torch.randint(-8, 9, (3, 7, 96), generator=gen) / 4).to(dev)
    x = torch.randn(7, 96, generator=gen).to(dtype).to(dev)
    w = (1 + 0.3 * torch.randn(96, generator=gen)).to(dtype).to(dev)
    total = (parts[0] + parts[1] + parts[2]).to(dtype)
    s, h = norms.add_rms_norm_triton(x, parts, w, 1e-6)
    s_ref, h_ref = norms.add_rms_norm_triton(x, total, w, 1e-6)
    assert torch.equal(s, s_ref)
    # The two compiled variants may sum the squares in another order: the norm may move by an ulp (seen on the H200
    # in float32), which can flip one rounding of the output.
    ulp = 1e-6 if dtype == torch.float32 else 2**-7
    assert torch.allclose(h.float(), h_ref.float(), rtol=2 * ulp, atol=1e-6)
    assert torch.equal(norms.add_rms_norm_torch(x, parts, w, 1e-6)[0], s_ref)

    hq, hkv, d, bs = 4, 2, 16, 4
    qkv_parts = (torch.randint(-8, 9, (2, 5, (hq + 2 * hkv) * d), generator=gen) / 4).to(dev)
    cos, sin = rope_tables(tiny_config("qwen3"), 64, dtype, torch.device(dev))
    pos = torch.tensor([0, 9, 33, 4, 63], device=dev)
    slots = torch.tensor([5, 0, 13, 14, 31], device=dev)
    caches = [torch.zeros(8, hkv, bs, d, dtype=dtype, device=dev) for _ in range(4)]
    q = rope_cache.rope_write_triton(qkv_parts, hq, hkv, cos, sin, pos, slots, caches[0], caches[1], None, None, 1e-6)
    q_ref = rope_cache.rope_write_triton(
        (qkv_parts[0] + qkv_parts[1]).to(dtype), hq, hkv, cos, sin, pos, slots, caches[2], caches[3], None, None, 1e-6
    )
    assert q.dtype == dtype and torch.equal(q, q_ref)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_cache_slots_torch_matches_hand_computed_slots():
    # Block size 16: position 17 of the sequence on table row [5, 9] is block 9's offset 1 → 9·16 + 1; position 3 of
    # row [2, 0] is 2·16 + 3; a padding row's position 40 runs past its two-block table and reads the last block.
    table = torch.tensor([[5, 9], [2, 0], [7, 4]], dtype=torch.int32)
    pos = torch.tensor([17, 3, 40])
    assert step_state.cache_slots_torch(table, pos, 16).tolist() == [145, 35, 4 * 16 + 8]


def test_advance_torch_moves_active_rows_only():
    tok, lp = torch.tensor([11, 12, 13]), torch.tensor([-0.5, -1.0, -2.0])
    out_tok, out_lp, tokens = torch.zeros(3, dtype=torch.long), torch.zeros(3), torch.zeros(3, dtype=torch.long)
    pos, steps, active = torch.tensor([4, 9, 0]), torch.tensor([1, 5, 0]), torch.tensor([1, 1, 0])
    step_state.advance_torch(tok, lp, out_tok, out_lp, tokens, pos, steps, active)
    assert out_tok.tolist() == tokens.tolist() == [11, 12, 13] and out_lp.tolist() == [-0.5, -1.0, -2.0]
    assert pos.tolist() == [5, 10, 0] and steps.tolist() == [2, 6, 0]


@needs_triton
@pytest.mark.parametrize("rows", [3, 256, 300])
def test_triton_step_state_matches_torch(rows):
    """Slots and the advance over more rows than one program takes (300), on a table view as the runner slices it."""
    g = torch.Generator().manual_seed(rows)
    dev = TRITON_DEVICE
    table = torch.randint(0, 1000, (rows + 5, 12), generator=g, dtype=torch.int32).to(dev)[:rows]
    pos = torch.randint(0, 16 * 14, (rows,), generator=g).to(dev)  # some past the table: padding rows
    assert torch.equal(step_state.cache_slots_triton(table, pos, 16), step_state.cache_slots_torch(table, pos, 16))
    tok = torch.randint(0, 50000, (rows,), generator=g).to(dev)
    lp = -torch.rand(rows, generator=g).to(dev)
    state = [
        torch.zeros(rows, dtype=torch.long, device=dev),
        torch.zeros(rows, device=dev),
        torch.randint(0, 9, (rows,), generator=g).to(dev),
        pos.clone(),
        torch.randint(0, 99, (rows,), generator=g).to(dev),
    ]
    active = (torch.rand(rows, generator=g) < 0.7).long().to(dev)
    ref = [t.clone() for t in state]
    step_state.advance_triton(tok, lp, *state, active)
    step_state.advance_torch(tok, lp, *ref, active)
    for got, want in zip(state, ref):
        assert torch.equal(got, want)


def test_split_count_splits_in_two_only_for_long_contexts(monkeypatch):
    """At most one program per SM's worth of splits for a small batch (132 SMs: 16 rows × 2 kv heads → 4); past that,
    two splits only from the long-context threshold (`long_context_keys`, whatever it is tuned to), never more splits
    than 64-key stretches of the tables nor than 32."""
    assert attention.split_count(16, 2, 40, 16, 132) == 4
    assert attention.split_count(256, 2, 40, 16, 132) == 1
    assert attention.split_count(1, 1, 2, 16, 132) == 1  # 32 keys in the tables: one stretch
    assert attention.split_count(1, 1, 4096, 16, 132) == 32
    monkeypatch.setattr(attention, "long_context_keys", lambda head_dim, programs, sms: 320)
    assert attention.split_count(256, 2, 40, 16, 132, keys=319) == 1
    assert attention.split_count(256, 2, 40, 16, 132, keys=320) == 2
    assert attention.split_count(256, 2, 2, 16, 132, keys=640) == 1  # 32 keys in the tables
    monkeypatch.setattr(attention, "long_context_keys", lambda head_dim, programs, sms: 0)
    assert attention.split_count(256, 2, 40, 16, 132, keys=10**6) == 1  # 0: never


def test_a_batch_that_fills_the_sms_splits_at_most_in_two():
    """Whatever the context, a batch with at least one program (row × kv head) per SM splits its keys in two at
    most: more splits would only add programs to an already full device."""
    for head_dim in (64, 128):
        for rows, kv_heads in ((66, 2), (128, 2), (256, 2), (132, 1)):
            for keys in (0, 256, 1024, 8192):
                assert 1 <= attention.split_count(rows, kv_heads, 1024, 16, 132, keys, head_dim) <= 2


def test_pdl_is_off_where_it_cannot_run_or_is_not_wanted():
    """On the CPU (and the interpreter) no launch asks for PDL and the kernels compile without the wait; inside
    `launches(False)` no launch asks for it anywhere, and the setting ends with the block."""
    from hybridrl.engines.native.kernels import pdl

    x = torch.zeros(2)
    assert not pdl.capable(x.device) and pdl.launch(x) == {"PDL": 0}
    assert pdl.wanted()
    with pdl.launches(False):
        assert not pdl.wanted() and pdl.launch(x) == {"PDL": 0}
        if CUDA:
            assert pdl.launch(x.cuda()) == {"PDL": 0}
        with pdl.launches(True):
            assert pdl.wanted()
        assert not pdl.wanted()
    assert pdl.wanted()


@pytest.mark.skipif(not CUDA, reason="programmatic dependent launch needs a GPU")
def test_pdl_launches_wait_for_the_kernel_ahead():
    """A CUDA graph of a long cuBLAS product whose output the norm kernel reads at once, then silu_mul on the norm's
    output and the norm again on that: with PDL every kernel starts before the one ahead has finished, so a missing
    wait would read the previous replay's values (each replay has new inputs) or the NaNs the outputs are filled
    with. Every replay equals the torch path on its inputs."""
    from hybridrl.engines.native.kernels import pdl

    dev = torch.device("cuda")
    if not pdl.capable(dev):
        pytest.skip("needs compute capability >= 9 and a Triton with grid dependency control")
    g = torch.Generator().manual_seed(0)
    n, h = 256, 1024
    a = torch.randn(n, 4096, generator=g).to(dev, torch.bfloat16)
    w = (torch.randn(2 * h, 4096, generator=g) / 64).to(dev, torch.bfloat16)
    x = torch.randn(n, 2 * h, generator=g).to(dev, torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(2 * h, generator=g)).to(dev, torch.bfloat16)
    nw2 = (1 + 0.1 * torch.randn(h, generator=g)).to(dev, torch.bfloat16)

    def chain():
        d = a @ w.t()
        s, normed = norms.add_rms_norm_triton(x, d, nw, 1e-6)
        act = norms.silu_mul_triton(normed)
        return s, norms.add_rms_norm_triton(act, act, nw2, 1e-6)[1]

    def reference():
        s, normed = norms.add_rms_norm_torch(x, a @ w.t(), nw, 1e-6)
        act = norms.silu_mul_torch(normed)
        return s, norms.add_rms_norm_torch(act, act, nw2, 1e-6)[1]

    assert pdl.launch(x) == {"PDL": 1, "launch_pdl": True}
    with pdl.launches(True):
        chain()  # compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain()
    for _ in range(5):
        a.copy_(torch.randn(a.shape, generator=g).to(dev, torch.bfloat16))
        want = reference()
        for t in outs:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for got, ref in zip(outs, want):
            assert not got.isnan().any()
            assert (got.float() - ref.float()).abs().max().item() <= 0.05
