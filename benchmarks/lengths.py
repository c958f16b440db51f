"""Response lengths as real RL batches have them, for the benchmarks' `--lengths` option.

Random-init models never stop early, so without help every benchmark row runs to the limit. A drawn mix::

    fixed      every response at the limit M (what the figures showed before)
    uniform    uniform in [M/32, M]
    lognormal  log-normal with median M/4 (sigma 1), capped at M: most short, a tail at the limit
    truncated  30% cut at M, the rest uniform in [M/32, M)
    heavy      90% uniform in [M/64, M/8], 10% at the limit M (a reasoning run's tail: at M = 4096, 64–512 and 4096)

In the step benchmark the engine stops each response at its drawn length (`cap_engine_lengths`): every request's
own token cap, which the native engine's scheduler honours like any stop (the row leaves the batch, its KV blocks
free), so the rollout, the log-probs and the update all see the mix; the tokens before the cap are the model's own
samples. The cap is the honest lever: the rollout's work shrinks exactly as it does when a model emits EOS early.
With partial rollouts (`--partial`) a sample may be continued in a later rollout as a new request: there the length
is drawn for the sample itself (`sample_length`: its prompt's tokens and its index), and the tokens it brings count
against it, so a carried sample ends where it would have ended uninterrupted.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

LENGTHS = ("fixed", "uniform", "lognormal", "truncated", "heavy")


def draw_length(kind: str, limit: int, rng: random.Random) -> int:
    """One response length in [1, limit] from the mix `kind`."""
    low = max(1, limit // 32)
    if kind == "fixed":
        return limit
    if kind == "uniform":
        return rng.randint(low, limit)
    if kind == "lognormal":
        return max(1, min(limit, round(math.exp(rng.gauss(math.log(limit / 4), 1.0)))))
    if kind == "truncated":
        return limit if rng.random() < 0.3 else rng.randint(low, max(low, limit - 1))
    if kind == "heavy":
        return limit if rng.random() < 0.1 else rng.randint(max(1, limit // 64), max(1, limit // 8))
    raise ValueError(f"unknown length mix {kind!r}; known: {', '.join(LENGTHS)}")


def draw_lengths(kind: str, limit: int, n: int, seed: int = 0) -> list[int]:
    """`n` lengths from the mix (the trainer benchmark's rows)."""
    rng = random.Random(seed)
    return [draw_length(kind, limit, rng) for _ in range(n)]


def request_length(kind: str, limit: int, seed: int | None, prompt_index: int, sample_index: int) -> int:
    """The drawn length of one request, fixed by its sampling seed and place (the same however batched)."""
    return draw_length(kind, limit, random.Random(f"{seed}/{prompt_index}/{sample_index}"))


def sample_length(kind: str, limit: int, prompt: Sequence[int], sample_index: int) -> int:
    """The drawn length of one sample, fixed by its prompt's tokens and its index: the same however batched, and in
    whichever rollout the sample is continued."""
    return draw_length(kind, limit, random.Random(f"{list(prompt)}/{sample_index}"))


def cap_engine_lengths(kind: str, prompt_len: int | None = None) -> None:
    """Make the native engine stop every request at its drawn length (`kind` of its max_new_tokens): the
    scheduler's per-sequence token cap is lowered as each request is queued. In this process only.

    Without `prompt_len` a request's length is keyed by its seed and place (`request_length`). With it (every prompt
    is that long), by the sample (`sample_length` of the first `prompt_len` tokens): a request with a longer context
    continues a sample carried from an earlier rollout, and stops once the sample's response reaches its length."""
    if kind == "fixed":
        return
    from hybridrl.engines.native import scheduler

    make = scheduler.Scheduler._sequence

    def capped(self, request, params):
        seq = make(self, request, params)
        if prompt_len is None:
            drawn = request_length(kind, params.max_new_tokens, params.seed, request.prompt_index, request.sample_index)
        else:
            carried = len(request.prompt_ids) - prompt_len
            total = sample_length(kind, params.max_new_tokens, request.prompt_ids[:prompt_len], request.sample_index)
            drawn = max(1, total - carried)
        seq.max_new = min(seq.max_new, drawn)
        return seq

    scheduler.Scheduler._sequence = capped
