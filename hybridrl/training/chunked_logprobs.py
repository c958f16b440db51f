"""Per-token log-probs (and entropy) straight from hidden states and the output embedding, in token chunks.

The plain path materializes the float32 logits of every kept position, [tokens, vocab] (about 4.4 GB for
8 × 1024 tokens at Qwen's 152k vocabulary), and autograd keeps them for the backward. Here the logits
live one chunk of at most `chunk` tokens at a time (chunks of equal size, `even_chunk`): the forward keeps only
each token's log-sum-exp, and the backward recomputes a chunk's logits, turns them into d(loss)/d(logits) and feeds
both matmuls. One extra [chunk, hidden] × [hidden, vocab] product per chunk buys logits memory that no longer grows
with the batch.

On GPU (`trainer.fused_logprobs`) each chunk's logits stay in the compute dtype and go through the fused log-prob
kernel (`logprob_kernel`) both ways, its gradient written over them: the logits of one chunk at a time, in bf16,
whatever the response share of a micro-batch; the head's weight gradient then sums the chunks in the weight's dtype.

`trainer.logprob_chunk_size` turns it on. Inside an FSDP2 root the output embedding is gathered only during
the root's forward (and again for its backward), so the computation runs there: `logprob_head` puts a
module in place of `lm_head` for one call, and the model's "logits" come out as [B, keep, 2] = (log-prob,
entropy) per position.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from hybridrl.training import logprob_kernel


def even_chunk(positions: int, chunk: int) -> int:
    """Positions per chunk when `positions` go through the head at most `chunk` at a time: as many chunks as the
    bound needs, of equal size, so the one buffer of a chunk's logits is as small as that count of chunks allows
    (8,563 positions at 8,192: two of 4,282, not 8,192 and 371)."""
    if positions <= 0:
        return max(1, chunk)
    return -(-positions // -(-positions // chunk))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    # The same product and upcast as the plain head (lm_head in the compute dtype, float32 after).
    logits = (hidden @ weight.t()).float()
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


class ChunkedLogprobs(torch.autograd.Function):
    """(log-prob [N], entropy [N]) of `targets` under softmax((hidden @ weight.T) / temperature)."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
        kernel: bool = False,
    ):
        n = hidden.shape[0]
        chunk = even_chunk(n, chunk)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.zeros_like(logp)
        fused = kernel and logprob_kernel.available(hidden)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            if fused:  # the entropy comes with the same read
                logp[s:e], lse[s:e], entropy[s:e] = logprob_kernel.forward_stats(
                    hidden[s:e] @ weight.t(), targets[s:e], temperature
                )
                continue
            x = _chunk_logits(hidden[s:e], weight, temperature)
            lse[s:e] = torch.logsumexp(x, dim=-1)
            logp[s:e] = x.gather(-1, targets[s:e, None]).squeeze(-1) - lse[s:e]
            if with_entropy:
                entropy[s:e] = lse[s:e] - (torch.exp(x - lse[s:e, None]) * x).sum(-1)
            del x  # before the next chunk's logits are made
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.fused = temperature, chunk, with_entropy, fused
        ctx.mark_non_differentiable(targets)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        with_entropy = ctx.with_entropy and grad_entropy is not None
        if ctx.fused:
            grad_w = torch.zeros_like(weight) if need_w else None
            # One chunk's buffer for every chunk: a fresh product per chunk would be allocated while the last
            # chunk's still lived (two chunks' logits at the peak).
            buf = hidden.new_empty(min(chunk, hidden.shape[0]), weight.shape[0])
            for s in range(0, hidden.shape[0], chunk):
                e = min(s + chunk, hidden.shape[0])
                d = torch.mm(hidden[s:e], weight.t(), out=buf[: e - s])  # recomputed, then overwritten by its gradient
                g_lp, g_ent = grad_logp[s:e], (grad_entropy[s:e] if with_entropy else None)
                logprob_kernel.backward_into(d, d, targets[s:e], temperature, lse[s:e], entropy[s:e], g_lp, g_ent)
                if need_h:  # into its rows of grad_h: a product then a copy would hold a chunk's twice
                    torch.mm(d, weight, out=grad_h[s:e])
                if need_w:
                    grad_w.addmm_(d.t(), hidden[s:e])
            return grad_h, grad_w, None, None, None, None, None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            x = _chunk_logits(hidden[s:e], weight, temperature)
            p = torch.exp(x - lse[s:e, None])
            g = grad_logp[s:e, None]
            # d logp / d x = onehot(target) - p
            d = p * -g
            d.scatter_add_(-1, targets[s:e, None], g)
            if with_entropy:
                # d H / d x_j = -p_j (x_j - E_p[x])
                mean_x = (p * x).sum(-1, keepdim=True)
                d.addcmul_(p * (x - mean_x), grad_entropy[s:e, None], value=-1.0)
            if temperature != 1.0:
                d.div_(temperature)
            d = d.to(hidden.dtype)
            if need_h:
                torch.mm(d, weight, out=grad_h[s:e])
            if need_w:
                grad_w += (d.t() @ hidden[s:e]).float()
            del x, p, d  # before the next chunk's are made
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk: int,
    with_entropy: bool = False,
    kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of `targets` ([...]) for `hidden` ([..., H]) under the head `weight` [V, H];
    `kernel`: through the fused log-prob kernel where it runs (GPU)."""
    shape = targets.shape
    lp, ent = ChunkedLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1).contiguous(),
        float(temperature),
        int(chunk),
        bool(with_entropy),
        bool(kernel),
    )
    return lp.view(shape), ent.view(shape)


class _LogprobHead(torch.nn.Module):
    """Stands in for `lm_head` for one forward: returns [B, T, 2] = (log-prob, entropy) of `targets`."""

    def __init__(
        self,
        head: torch.nn.Linear,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
        kernel: bool = False,
    ) -> None:
        super().__init__()
        if getattr(head, "bias", None) is not None:
            raise NotImplementedError("trainer.logprob_chunk_size needs an output head without bias")
        self.head = head  # FSDP2 swaps the gathered weight into this module, so it is read at call time
        self.targets, self.temperature, self.chunk, self.with_entropy = targets, temperature, chunk, with_entropy
        self.kernel = kernel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        lp, ent = chunked_token_logprobs(
            hidden, self.head.weight, self.targets, self.temperature, self.chunk, self.with_entropy, self.kernel
        )
        return torch.stack([lp, ent], dim=-1)


@contextmanager
def logprob_head(
    model: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float,
    chunk: int,
    with_entropy: bool,
    kernel: bool = False,
):
    """Within the block, `model(...).logits` is [B, keep, 2]: the log-prob of `targets` [B, keep] and the
    entropy at each kept position, computed `chunk` tokens at a time (`kernel`: through the fused kernel on GPU)."""
    head = model.get_output_embeddings()
    name = next((n for n, m in model.named_children() if m is head), None)
    if name is None:
        raise NotImplementedError(f"trainer.logprob_chunk_size: cannot find the output head of {type(model).__name__}")
    setattr(model, name, _LogprobHead(head, targets, temperature, chunk, with_entropy, kernel))
    try:
        yield
    finally:
        setattr(model, name, head)
