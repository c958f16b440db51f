"""What the step's trainer passes computed: real tokens, padding, seconds, and torch.compile's count.

The actor, the reference and the critic share one meter on a worker. The step's first trainer pass (the actor's
log-probs) starts it afresh; the updates report it, so the last one of the step (the actor's) covers them all::

    meter.start_step()                               # Trainer.compute_logprobs
    with meter.timed(micro):                         # every forward (and backward) over a micro-batch list
        ...
    metrics.update(meter.metrics())                  # Critic.update, Trainer.update

A pass ends by reading its results on the host (log-probs, values, the loss or gradient norm), which waits for the
device, so wall time around it is the pass's time without an extra synchronization.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol


class Counted(Protocol):
    """A micro-batch as the meter reads it."""

    real_tokens: int
    computed_tokens: int


def compile_count() -> int:
    """Frames torch.compile has compiled in this process so far (first compiles and recompiles alike; the trainer's
    decoder layers are what compiles in a run)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


class PassMeter:
    """Token and time totals of one step's trainer passes."""

    def __init__(self) -> None:
        self.start_step()

    def start_step(self) -> None:
        """Forget the previous step's passes."""
        self.real = self.computed = 0
        self.seconds = 0.0

    @contextmanager
    def timed(self, micro: Sequence[Counted]) -> Iterator[None]:
        """Count `micro`'s tokens and the block's wall time as one pass over them."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.record(micro, time.perf_counter() - t0)

    def record(self, micro: Sequence[Counted], seconds: float) -> None:
        """Count one pass over `micro` that took `seconds`."""
        self.seconds += seconds
        self.real += sum(m.real_tokens for m in micro)
        self.computed += sum(m.computed_tokens for m in micro)

    def metrics(self) -> dict[str, float]:
        """`perf/pad_frac` (positions computed that hold no token / positions computed), `perf/trainer_tokens_per_s`
        (real tokens per second of trainer passes, on this device) and `trainer/compiles` (cumulative)."""
        out = {"trainer/compiles": float(compile_count())}
        if self.computed:
            out["perf/pad_frac"] = 1.0 - self.real / self.computed
        if self.seconds > 0:
            out["perf/trainer_tokens_per_s"] = self.real / self.seconds
        return out
