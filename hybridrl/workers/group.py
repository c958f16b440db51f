"""WorkerGroup: send a phase command to every worker, scatter batches by rank, gather results.

The controller only talks to this interface, so `inline`, `local` and `ray` backends are
interchangeable. Ranks form engine tensor-parallel groups of `tp_size` consecutive ranks;
every rank of one TP group gets the same prompts, and one result per group comes back.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from hybridrl.batch import Batch
from hybridrl.engines.base import Completion, SamplingParams


class WorkerGroup(abc.ABC):
    """All workers of a run, addressed together."""

    def __init__(self, world_size: int, tp_size: int) -> None:
        self.world_size, self.tp_size = world_size, tp_size

    @property
    def engine_dp_size(self) -> int:
        """Number of engine TP groups (each generates for its own share of prompts)."""
        return self.world_size // self.tp_size

    @abc.abstractmethod
    def run(self, method: str, per_rank_args: Sequence[tuple] | None = None, **kwargs: Any) -> list[Any]:
        """Call `method` on every worker (rank r gets `per_rank_args[r]`, all get `kwargs`); results by rank."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; safe to call twice."""

    # -- helpers every backend shares -------------------------------------------------------
    def run_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """The same call on every worker."""
        return self.run(method, [args] * self.world_size, **kwargs)

    def run_scattered(self, method: str, batch: Batch, **kwargs: Any) -> list[Any]:
        """Split `batch` into equal consecutive shards by rank and run `method` on each."""
        return self.run(method, [(shard,) for shard in batch.split(self.world_size)], **kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], step: int, params: SamplingParams) -> list[Completion]:
        """Prompts split over engine TP groups (consecutive shares); completions back in prompt order."""
        dp = self.engine_dp_size
        share = -(-len(prompts) // dp)
        parts = [list(prompts[g * share : (g + 1) * share]) for g in range(dp)]
        results = self.run(
            "generate",
            [(parts[r // self.tp_size], step, params, (r // self.tp_size) * share) for r in range(self.world_size)],
        )
        out: list[Completion] = []
        for g in range(dp):
            for c in results[g * self.tp_size]:  # the TP group's first rank speaks for it
                c.prompt_index += g * share
                out.append(c)
        return out


class InlineWorkerGroup(WorkerGroup):
    """One worker inside the controller process (the default on CPU or one GPU, and in tests)."""

    def __init__(self, cfg) -> None:
        super().__init__(world_size=1, tp_size=cfg.engine.tp_size)
        from hybridrl.workers.worker import HybridWorker

        self.worker: Any = HybridWorker(cfg, rank=0, world_size=1, local_rank=0)

    def run(self, method: str, per_rank_args: Sequence[tuple] | None = None, **kwargs: Any) -> list[Any]:
        args = per_rank_args[0] if per_rank_args else ()
        return [getattr(self.worker, method)(*args, **kwargs)]

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None


def build_worker_group(cfg) -> WorkerGroup:
    """The backend `cluster.name` selects."""
    if cfg.cluster.name == "inline":
        return InlineWorkerGroup(cfg)
    if cfg.cluster.name == "local":
        from hybridrl.workers.local import LocalWorkerGroup

        return LocalWorkerGroup(cfg)
    from hybridrl.workers.ray_group import RayWorkerGroup

    return RayWorkerGroup(cfg)
