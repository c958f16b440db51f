"""The engine role: a rollout engine and the resharder that keeps its weights equal to the actor's.

Its part of one iteration::

    rollout.wake()                            # phase "wake": weights and KV cache on the device
    comps = rollout.generate(prompts, params) # phase "generate"
    rollout.sleep()                           # phase "sleep": engine.sleep_level frees KV (and weights); 0 nothing
    rollout.sync(actor.model)                 # phase "reshard": gather → fuse → split → deliver, layer by layer
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from hybridrl.data.images import ImageInputs
from hybridrl.engines.base import Completion, GenerationRequest, RolloutEngine, SamplingParams
from hybridrl.reshard import Resharder


class Rollout:
    """A rollout engine with its weight sync; no state of its own to checkpoint (the actor's weights are it)."""

    name = "engine"

    def __init__(self, engine: RolloutEngine, resharder: Resharder, sleep_level: int) -> None:
        self.engine, self.resharder, self.sleep_level = engine, resharder, sleep_level

    def wake(self) -> None:
        """Weights, then the KV cache, back on the device."""
        self.engine.wake_up(["weights", "kv_cache"])

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[Completion]:
        """`params.n` completions per prompt, with their images where given (see `RolloutEngine.generate`)."""
        if images is None:
            return self.engine.generate(prompts, params)
        return self.engine.generate(prompts, params, images)

    def generate_requests(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        """One completion per request (see `GenerationRequest`)."""
        return self.engine.generate_requests(list(requests), params)

    def sleep(self) -> None:
        """Give the device back to the trainer roles (at sleep level 0: keep it all; the trainer runs beside)."""
        if self.sleep_level:
            self.engine.sleep(self.sleep_level)

    def sync(self, model: torch.nn.Module) -> dict[str, float]:
        """Stream `model`'s weights into the engine (waking its weights first); this rank's reshard figures."""
        t0 = time.perf_counter()
        self.engine.wake_up(["weights"])
        stats = self.resharder.sync(model).metrics()
        self.engine.finish_weight_update()
        stats["reshard/seconds"] = time.perf_counter() - t0
        return stats

    def memory_stats(self) -> dict[str, float]:
        """The engine's own figures (GiB of weights and KV cache where it can tell)."""
        return self.engine.memory_stats()

    def shutdown(self) -> None:
        """Free the engine."""
        self.engine.shutdown()
