"""Chunked log-probs (`trainer.logprob_chunk_size`): values and gradients equal the plain head's."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tests.triton_interpret  # noqa: F401  (the interpreter's numpy fix, when it is on)
from hybridrl.training import logprob_kernel
from hybridrl.training.chunked_logprobs import chunked_token_logprobs, even_chunk
from hybridrl.training.logprobs import response_logprobs
from tests.unit.training.test_trainer import make_trainer, rollout, setup  # noqa: F401 - setup is a fixture


def reference(hidden, weight, targets, temperature):
    x = (hidden @ weight.t()).float() / temperature
    logp = torch.log_softmax(x, -1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


class OpsCalled(TorchDispatchMode):
    """The aten operators run inside it, in order (`names`)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


KERNEL = pytest.param(
    True,
    marks=[
        pytest.mark.interpreted,
        pytest.mark.skipif(
            not logprob_kernel.available(torch.empty(0)) and not torch.cuda.is_available(),
            reason="the fused kernel needs Triton, and CUDA or the interpreter (HYBRIDRL_KERNELS_ON_CPU=1)",
        ),
    ],
    id="fused",
)


@pytest.mark.parametrize("kernel", [pytest.param(False, id="torch"), KERNEL])
@pytest.mark.parametrize("temperature,chunk", [(1.0, 8), (0.7, 5), (1.3, 100)])
def test_values_and_gradients_match_the_plain_head(temperature, chunk, kernel):
    """Both ways of a chunk (float32 torch; the fused kernel, its gradient over the chunk's logits)."""
    device = "cuda" if kernel and torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    n, h, v = 37, 16, 50
    hidden = torch.randn(n, h, generator=g).to(device).requires_grad_()
    weight = torch.randn(v, h, generator=g).to(device).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    a, b = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)

    lp, ent = chunked_token_logprobs(hidden, weight, targets, temperature, chunk, with_entropy=True, kernel=kernel)
    ((lp * a).sum() + (ent * b).sum()).backward()
    got = (lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None

    rlp, rent = reference(hidden, weight, targets, temperature)
    ((rlp * a).sum() + (rent * b).sum()).backward()
    want = (rlp.detach(), rent.detach(), hidden.grad, weight.grad)
    for name, x, y in zip(("logp", "entropy", "d hidden", "d weight"), got, want):
        assert torch.allclose(x, y, atol=1e-4, rtol=1e-4), (name, (x - y).abs().max())


def test_without_entropy_its_gradient_is_not_taken():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 8, generator=g, requires_grad=True)
    weight = torch.randn(20, 8, generator=g)
    targets = torch.randint(0, 20, (9,), generator=g)
    lp, ent = chunked_token_logprobs(hidden, weight, targets, 1.0, 4, with_entropy=False)
    assert torch.equal(ent, torch.zeros(9))
    (lp.sum() + ent.sum()).backward()
    rlp, _ = reference(hidden.detach().requires_grad_(), weight, targets, 1.0)
    assert torch.allclose(lp, rlp, atol=1e-6)


def test_trainer_with_chunks_equals_trainer_without(tiny_path, tokenizer, process_group, setup):  # noqa: F811
    """Through the FSDP2 model: same old/ref log-probs, entropy, and the same update."""
    engine, prompts = setup
    batch = rollout(engine, prompts)
    results = []
    for chunk in (0, 7):
        torch.manual_seed(0)
        # float32 on a GPU too (auto is bfloat16 there, where the head's weight gradient is rounded once unchunked
        # and summed in float32 over chunks: equal only to bfloat16's precision)
        trainer = make_trainer(tiny_path, tokenizer, temperature=0.8, logprob_chunk_size=chunk, param_dtype="float32")
        out = trainer.logprob(batch)
        b = batch.select(range(len(batch)))
        for k, v in out.items():
            b[k] = v
        b["advantages"] = torch.linspace(-1, 1, len(b))
        grads = {}
        real_step = trainer.roles.actor.optimizer.step

        def spy(*a, _real=real_step, _trainer=trainer, _grads=grads, **kw):
            _grads.update({n: p.grad.full_tensor().clone() for n, p in _trainer.roles.actor.model.named_parameters()})
            return _real(*a, **kw)

        trainer.roles.actor.optimizer.step = spy
        metrics = trainer.roles.actor.update(b)
        results.append((out, metrics, grads))
    (o0, m0, p0), (o1, m1, p1) = results
    for k in o0:
        assert torch.allclose(o0[k], o1[k], atol=1e-5), k
    assert m0["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-4)
    assert p0 and p0.keys() == p1.keys()
    for n in p0:  # the gradients (Adam's first step is ~lr·sign(grad): parameters would hide small differences)
        assert torch.allclose(p0[n], p1[n], atol=1e-6, rtol=1e-4), n


def test_response_logprobs_chunked_on_a_plain_model(tiny_path, tokenizer):
    """Without FSDP too (the head swap works on any HF causal LM), entropy included."""
    from hybridrl.models.config import ModelConfig
    from hybridrl.models.loading import load_causal_lm

    model = load_causal_lm(tiny_path, ModelConfig(), torch.float32)
    prompts = [[1, 5, 9, 4], [3, 3]]
    resp = torch.tensor([[7, 8, 9], [10, 11, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    plain = response_logprobs(model, prompts, resp, mask, 0.9, tokenizer.pad_token_id, with_entropy=True)
    chunked = response_logprobs(
        model, prompts, resp, mask, 0.9, tokenizer.pad_token_id, with_entropy=True, chunk_size=2
    )
    assert torch.allclose(plain[0], chunked[0], atol=1e-5)
    assert torch.allclose(plain[1], chunked[1], atol=1e-5)
    assert type(model.lm_head).__name__ == "Linear"  # the head is put back


def test_a_pass_within_the_chunk_size_keeps_the_plain_head(tiny_path, tokenizer, monkeypatch):
    """The chunk size bounds the positions with logits at once: fewer than that need no chunks (nor the recompute)."""
    import hybridrl.training.logprobs as logprobs
    from hybridrl.models.config import ModelConfig
    from hybridrl.models.loading import load_causal_lm

    model = load_causal_lm(tiny_path, ModelConfig(), torch.float32)
    prompts = [[1, 5, 9, 4], [3, 3]]
    resp = torch.tensor([[7, 8, 9], [10, 11, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    swaps = []
    real_head = logprobs.logprob_head
    monkeypatch.setattr(logprobs, "logprob_head", lambda *a, **kw: swaps.append(a[3]) or real_head(*a, **kw))
    # 2 rows × 6 kept positions (from the shorter prompt's end) = 12 positions with logits
    for chunk in (12, 11):
        response_logprobs(model, prompts, resp, mask, 1.0, tokenizer.pad_token_id, chunk_size=chunk)
    assert swaps == [11]


@pytest.fixture
def kernel_in_torch(monkeypatch):
    """The fused log-prob kernel's two entry points done in torch (the chunk loop's fused way runs on any machine);
    yields the gradient buffers `backward_into` was given, as (storage address, rows)."""
    buffers = []

    def forward_stats(logits, targets, temperature):
        x = logits.float() / temperature
        lse = torch.logsumexp(x, -1)
        p = torch.softmax(x, -1)
        return x.gather(-1, targets[:, None]).squeeze(-1) - lse, lse, lse - (p * x).sum(-1)

    def backward_into(logits, out, targets, temperature, lse, ent, g_lp, g_ent):
        buffers.append((out.untyped_storage().data_ptr(), out.shape[0]))
        x = logits.float() / temperature
        p = torch.exp(x - lse[:, None])
        d = -p * g_lp[:, None]
        d.scatter_add_(-1, targets[:, None], g_lp[:, None])
        if g_ent is not None:
            d -= g_ent[:, None] * p * (x - (lse - ent)[:, None])
        out.copy_(d / temperature)
        return out

    monkeypatch.setattr(logprob_kernel, "available", lambda t: True)
    monkeypatch.setattr(logprob_kernel, "forward_stats", forward_stats)
    monkeypatch.setattr(logprob_kernel, "backward_into", backward_into)
    yield buffers


def test_the_fused_way_recomputes_every_chunk_into_one_buffer(kernel_in_torch):
    """The fused path's chunk loop (torch standing in for the Triton kernel): the values and gradients of the plain
    head, every chunk's logits written into the same buffer (a fresh one per chunk was made while the last still
    lived: two chunks' logits at the update's peak), and every product into memory it was given."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 37, 16, 50
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    a, b = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)

    lp, ent = chunked_token_logprobs(hidden, weight, targets, 0.7, 8, with_entropy=True, kernel=True)
    loss = (lp * a).sum() + (ent * b).sum()
    with OpsCalled() as ops:
        loss.backward()
    got = (lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    rlp, rent = reference(hidden, weight, targets, 0.7)
    ((rlp * a).sum() + (rent * b).sum()).backward()
    for name, x, y in zip(("logp", "entropy", "d hidden", "d weight"), got, (rlp, rent, hidden.grad, weight.grad)):
        assert torch.allclose(x.double(), y.double(), atol=1e-5), name
    # 37 positions at most 8 at a time: five chunks of 8, 8, 8, 8 and 5 in one buffer.
    assert [rows for _, rows in kernel_in_torch] == [8, 8, 8, 8, 5] and len({a for a, _ in kernel_in_torch}) == 1
    # Every product lands in memory it was given: a fresh one (then copied into the gradient) is a chunk's more.
    assert "aten.mm.default" not in ops.names and ops.names.count("aten.mm.out") == 10


@pytest.mark.parametrize(
    "positions,bound,rows",
    [(37, 8, 8), (10, 8, 5), (8, 8, 8), (8563, 8192, 4282), (16384, 8192, 8192), (16385, 8192, 5462), (1, 8192, 1)],
)
def test_even_chunks_are_as_few_as_the_bound_needs_and_of_equal_size(positions, bound, rows):
    assert even_chunk(positions, bound) == rows


def test_chunks_of_equal_size_hold_a_smaller_buffer(kernel_in_torch):
    """20 positions at most 16 at a time go through the head as two chunks of 10: the buffer holds 10 rows, not 16."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(20, 8, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(30, 8, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 30, (20,), generator=g)
    lp, _ = chunked_token_logprobs(hidden, weight, targets, 1.0, 16, kernel=True)
    lp.sum().backward()
    rlp, _ = reference(hidden.detach(), weight.detach(), targets, 1.0)
    assert torch.allclose(lp.detach(), rlp, atol=1e-10)
    assert [rows for _, rows in kernel_in_torch] == [10, 10]
