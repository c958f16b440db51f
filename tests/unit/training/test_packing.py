"""Packed inputs and the attention that keeps packed sequences apart, against per-sequence forwards."""

from __future__ import annotations

import pytest
import torch

from hybridrl.training.attention import resolve, use_packed_attention
from hybridrl.training.logprobs import packed_logprobs
from hybridrl.training.packing import pack_rows, padded_length
from tests.tiny_models import KINDS, reference_logprobs, tiny_model

PAD = 0


def test_padded_length_ladder_by_hand():
    # 16 sizes per octave, multiples of 8 below 256: 2**(floor(log2 n) - 4), at least 8.
    assert [padded_length(n) for n in (1, 8, 9, 100, 128, 129, 1000, 1025, 14000)] == [
        8,
        8,
        16,
        104,
        128,
        136,
        1024,
        1088,
        14336,
    ]
    # A budget caps the tail (a micro-batch filled to 15,000 of a 15,000-token budget is not padded past it) ...
    assert padded_length(14000, cap=14100) == 14100
    # ... but a longer sequence is never cut.
    assert padded_length(14000, cap=9000) == 14336


def test_padded_lengths_are_few_and_waste_at_most_a_sixteenth():
    sizes = {padded_length(n) for n in range(1, 16385)}
    assert len(sizes) <= 16 * 11  # at most 16 per octave
    assert len({padded_length(n) for n in range(8192, 16385)}) == 17  # 16 per octave (+ 16384 itself)
    assert all(padded_length(n) - n <= max(7, n / 16) for n in range(1, 20000))


def test_pack_rows_layout_by_hand():
    prompts = [[11, 12], [21], [31, 32, 33]]
    responses = torch.tensor([[13, 14, 15], [22, 23, 0], [34, 0, 0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 0, 0]])  # row 0: token 14 out of the loss; row 2: none
    packed = pack_rows(prompts, responses, mask, [3, 2, 1], PAD)
    # 5 + 3 + 4 = 12 real tokens, padded to 16: a tail of 4 pad tokens, its own sequence.
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 15, 21, 22, 23, 31, 32, 33, 34, 0, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3]]
    assert packed.cu_seqlens.tolist() == [0, 5, 8, 12, 16]
    assert packed.max_length == 8  # longest 5, as a power of two
    # Token 13 is predicted at position 1, token 15 at 3; tokens 22, 23 at 5, 6.
    assert packed.kept.tolist() == [1, 3, 5, 6]
    assert packed.targets.tolist() == [13, 15, 22, 23]
    assert (packed.real_tokens, packed.computed_tokens) == (12, 16)
    out = packed.scatter(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert out.tolist() == [[1.0, 0.0, 2.0], [3.0, 4.0, 0.0], [0.0, 0.0, 0.0]]


def test_a_micro_batch_without_loss_tokens_still_runs_a_differentiable_forward():
    packed = pack_rows([[5, 6]], torch.tensor([[7, 8]]), torch.zeros(1, 2), [2], PAD)
    assert packed.kept.tolist() == [0] and packed.flat_index.numel() == 0
    x = torch.ones(1, requires_grad=True)
    out = packed.scatter(x * 2)
    assert out.tolist() == [[0.0, 0.0]] and out.requires_grad


def test_auto_picks_varlen_for_sdpa_and_the_models_own_otherwise():
    assert resolve("auto", "sdpa") == "varlen"
    assert resolve("auto", "flash_attention_2") == "model"
    assert resolve("auto", "eager") == "model"
    assert resolve("model", "sdpa") == "model"


SEQS = [([5, 17, 3], [9, 11, 4, 2]), ([21, 2], [8]), ([7, 8, 9, 10], [11, 12, 13, 14, 15])]


def packed_case(seqs, cap: int = 0):
    prompts = [p for p, _ in seqs]
    width = max(len(r) for _, r in seqs)
    responses = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width)
    for i, (_, r) in enumerate(seqs):
        responses[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return pack_rows(prompts, responses, mask, [len(r) for _, r in seqs], PAD, cap)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("attention", ["varlen", "model"])
def test_packed_logprobs_equal_one_forward_per_sequence(kind, attention):
    """Reference: each sequence alone, unpadded, in its own forward (no packing, no mask)."""
    model = tiny_model(kind)
    use_packed_attention(model, attention, "sdpa")
    with torch.no_grad():
        lp, ent = packed_logprobs(model, packed_case(SEQS), 0.8, with_entropy=True, kernel=False)
    plain = tiny_model(kind)
    for i, (prompt, resp) in enumerate(SEQS):
        want = reference_logprobs(plain, prompt, resp, 0.8)
        torch.testing.assert_close(lp[i, : len(resp)], want, rtol=0, atol=1e-5)
        assert (lp[i, len(resp) :] == 0).all() and (ent[i, len(resp) :] == 0).all()
        assert (ent[i, : len(resp)] > 0).all()


@pytest.mark.parametrize("attention", ["varlen", "model"])
def test_changing_one_sequence_leaves_the_others_bit_identical(attention):
    model = tiny_model("llama")
    use_packed_attention(model, attention, "sdpa")
    other = [SEQS[0], ([21, 2], [98]), SEQS[2]]  # the middle sequence's response token changed, lengths kept
    with torch.no_grad():
        a, _ = packed_logprobs(model, packed_case(SEQS), 1.0, kernel=False)
        b, _ = packed_logprobs(model, packed_case(other), 1.0, kernel=False)
    assert not torch.equal(a[1], b[1])
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])


def test_a_long_sequence_packed_with_short_ones_scores_as_it_does_alone():
    """The long-context case at CPU scale: 1,500 tokens beside two short sequences, under a budget smaller than
    the long one (it runs whole, never cut)."""
    g = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(1, 99, (700,), generator=g).tolist()
    long_resp = torch.randint(1, 99, (800,), generator=g).tolist()
    seqs = [SEQS[1], (long_prompt, long_resp), SEQS[0]]
    model = tiny_model("llama", max_position_embeddings=2048)
    use_packed_attention(model, "varlen", "sdpa")
    packed = packed_case(seqs, cap=1024)
    assert packed.computed_tokens >= packed.real_tokens > 1500
    with torch.no_grad():
        lp, _ = packed_logprobs(model, packed, 1.0, kernel=False)
    plain = tiny_model("llama", max_position_embeddings=2048)
    for i, (prompt, resp) in enumerate(seqs):
        torch.testing.assert_close(lp[i, : len(resp)], reference_logprobs(plain, prompt, resp), rtol=0, atol=1e-5)


def test_a_varlen_model_called_with_a_padded_batch_masks_the_padding():
    """Without cu_seqlens (a padded batch and its attention mask: e.g. `generate`), the varlen attention is causal
    sdpa with the padding mask, as the model's own sdpa is."""
    varlen, plain = tiny_model("qwen3"), tiny_model("qwen3")
    use_packed_attention(varlen, "varlen", "sdpa")
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        got = varlen(input_ids=ids, attention_mask=mask, use_cache=False).logits
        want = plain(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernel needs a GPU")
def test_the_cuda_varlen_kernel_agrees_with_one_forward_per_sequence_and_trains():
    from hybridrl.training.attention import kernel_available

    model = tiny_model("qwen2").cuda().to(torch.bfloat16)
    use_packed_attention(model, "varlen", "sdpa")
    packed = packed_case(SEQS).to(torch.device("cuda"))
    assert kernel_available(torch.zeros(1, device="cuda", dtype=torch.bfloat16))
    lp, _ = packed_logprobs(model, packed, 1.0, kernel=False)
    plain = tiny_model("qwen2").cuda().to(torch.bfloat16)
    for i, (prompt, resp) in enumerate(SEQS):
        want = reference_logprobs(plain, prompt, resp).float()
        torch.testing.assert_close(lp[i, : len(resp)].float().cpu(), want, rtol=0, atol=5e-2)
    lp.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
