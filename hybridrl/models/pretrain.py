"""Language-model pre-training of the tiny model on generic digit text, run once when the model is made.

The text: documents of digits drawn from a fixed random second-order Markov chain, in which now and then a
span from earlier in the same document recurs (`...58302917...0291...`), each document ended by EOS.
Predicting it well takes two skills a language model needs: what the last two digits say about the next
(a previous-token attention head), and continuing a span seen before (in-context copying, the "induction
heads" of larger models). Without this step a random-init model of this size never finds the second by RL.

What it does not teach: the text has no chat markup, no instruction words, no prompt and no answer, and
where a span recurs is random. On the synthetic `copy:` task the pre-trained model starts near chance
(`reward/correct` about 0.1): RL has to learn to answer after the chat markup, to start the answer with the
prompt's first digit, and to stop with EOS once the digits are copied.

    model = fresh tiny model (seeded)
    for step in range(steps):   # AdamW, linear warmup then cosine, next-token loss on every position
        loss = lm_loss(model, next_batch(rng))
    saved with the model (the spec is part of its cache key)

Deterministic for a seed: the text comes from `random.Random(seed)` and the loop runs on one thread.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import asdict, dataclass

import torch

DIGITS = "0123456789"


@dataclass(frozen=True)
class PretrainSpec:
    """How the tiny model is pre-trained (all of it is part of the tiny model's cache key)."""

    steps: int = 0
    """Optimizer steps; 0 keeps the random initialization."""
    batch_size: int = 32
    """Sequences per step."""
    seq_len: int = 64
    """Tokens per sequence (documents are packed, each ended by EOS)."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warmup over the first 5% of steps, cosine to 10% after)."""
    repeat_prob: float = 0.5
    """Chance, at each break in the Markov text, that a span from earlier in the document recurs."""
    min_span: int = 3
    """Shortest recurring span (tokens)."""
    max_span: int = 8
    """Longest recurring span (tokens)."""
    doc_len: tuple[int, int] = (16, 64)
    """Shortest and longest document (digits)."""
    sharpness: float = 2.5
    """Scale of the Markov chain's random logits: higher makes the next digit more predictable."""
    seed: int = 0
    """Seed of the chain, the text and the data order."""

    def key(self) -> dict:
        """The spec as plain data (for the cache key)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


class DigitText:
    """The generator of the pre-training text (see the module doc), seeded."""

    def __init__(self, spec: PretrainSpec) -> None:
        self.spec, self.rng = spec, random.Random(spec.seed)
        # Cumulative next-digit distributions for every (previous, current) pair.
        self.cdf: dict[tuple[int, int], list[float]] = {}
        for a, b in itertools.product(range(10), repeat=2):
            w = [math.exp(spec.sharpness * self.rng.gauss(0.0, 1.0)) for _ in range(10)]
            total = sum(w)
            self.cdf[a, b] = list(itertools.accumulate(x / total for x in w))

    def _next(self, a: int, b: int) -> int:
        return min(9, bisect.bisect_left(self.cdf[a, b], self.rng.random()))

    def document(self) -> list[int]:
        """One document as digit values 0-9."""
        s, rng = self.spec, self.rng
        n = rng.randint(*s.doc_len)
        doc = [rng.randrange(10), rng.randrange(10)]
        while len(doc) < n:
            if len(doc) > s.min_span + 2 and rng.random() < s.repeat_prob:
                start = rng.randrange(0, len(doc) - s.min_span)
                doc.extend(doc[start : start + rng.randint(s.min_span, s.max_span)])
            else:
                for _ in range(rng.randint(1, 6)):
                    doc.append(self._next(doc[-2], doc[-1]))
        return doc[:n]


def pretrain_batches(tokenizer, spec: PretrainSpec):
    """An endless, seeded stream of (batch_size, seq_len) token-id tensors of packed documents."""
    vocab = tokenizer.get_vocab()
    digit_ids = [vocab[ch] for ch in DIGITS]  # byte-level: one token per digit
    eos = tokenizer.eos_token_id
    text = DigitText(spec)
    stream: list[int] = []
    while True:
        rows = []
        for _ in range(spec.batch_size):
            while len(stream) < spec.seq_len:
                stream.extend(digit_ids[d] for d in text.document())
                stream.append(eos)
            rows.append(stream[: spec.seq_len])
            del stream[: spec.seq_len]
        yield torch.tensor(rows, dtype=torch.long)


def pretrain(model: torch.nn.Module, tokenizer, spec: PretrainSpec) -> list[float]:
    """Train `model` in place on digit text for `spec.steps` steps; returns the loss of every step."""
    if spec.steps <= 0:
        return []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same arithmetic on every machine (and no slower for a model this small)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            return _train(model, tokenizer, spec)
    finally:
        torch.set_num_threads(threads)


def warmup_cosine_adamw(model: torch.nn.Module, lr: float, steps: int):
    """AdamW over `model` with a linear warm-up over the first 5% of `steps`, then a cosine decay to 10% of `lr`:
    (optimizer, scheduler)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at)


def _train(model: torch.nn.Module, tokenizer, spec: PretrainSpec) -> list[float]:
    opt, sched = warmup_cosine_adamw(model, spec.lr, spec.steps)
    model.train()
    losses = []
    batches = pretrain_batches(tokenizer, spec)
    for _ in range(spec.steps):
        x = next(batches)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return losses
