"""WorkerGroup: send a phase command to every worker, scatter batches by rank, gather results.

The controller only talks to this interface, so `inline`, `local` and `ray` backends are interchangeable. Which
rank gets which prompts and rows is the run's `Topology`'s to say; every rank of an engine TP group gets the same
prompts, and the group's leader speaks for it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from hybridrl.batch import Batch
from hybridrl.data.images import ImageInputs
from hybridrl.engines.base import Completion, SamplingParams
from hybridrl.phases import Phase
from hybridrl.topology import Topology


class WorkerGroup(abc.ABC):
    """All workers of a run, addressed together."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return self.topology.world_size

    @abc.abstractmethod
    def run(self, phase: Phase, per_rank_args: Sequence[tuple] | None = None, **kwargs: Any) -> list[Any]:
        """Run `phase` on every worker (rank r gets `per_rank_args[r]`, all get `kwargs`); results by rank."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; safe to call twice."""

    # -- helpers every backend shares -------------------------------------------------------
    def run_all(self, phase: Phase, *args: Any, **kwargs: Any) -> list[Any]:
        """The same call on every worker."""
        return self.run(phase, [args] * self.world_size, **kwargs)

    def run_scattered(self, phase: Phase, batch: Batch, **kwargs: Any) -> list[Any]:
        """Each rank its shard of `batch` (the topology's row slices) for `phase`."""
        return self.run(phase, [(batch.select(s),) for s in self.topology.row_slices(len(batch))], **kwargs)

    def run_data_parallel(self, phase: Phase, batch: Batch, **kwargs: Any) -> list[Any]:
        """A trainer phase: each data-parallel rank its shard of `batch`, the same for every rank of a
        sequence-parallel group; one result per data-parallel rank (its group's first rank's), in row order."""
        topo = self.topology
        shards = [batch.select(s) for s in topo.dp_row_slices(len(batch))]
        results = self.run(phase, [(shards[topo.of_rank(r).dp_rank],) for r in range(self.world_size)], **kwargs)
        return [results[r] for r in topo.dp_leaders()]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        step: int,
        params: SamplingParams,
        first_index: int = 0,
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[Completion]:
        """Prompts split over the engine replicas; completions back in prompt order (indices into `prompts`).
        `first_index` is the global index of `prompts[0]` in the step's random streams (a later round of the
        same step passes the number of prompts already drawn, so it never repeats their samples). `images[i]`:
        prompt i's images (a vision-language model), travelling with it."""
        topo = self.topology
        shares = topo.prompt_slices(len(prompts))
        args = []
        for r in range(self.world_size):
            share = shares[topo.of_rank(r).engine_dp_rank]
            arg = (list(prompts[share]), step, params, first_index + share.start)
            args.append(arg if images is None else (*arg, list(images[share])))
        results = self.run(Phase.GENERATE, args)
        out: list[Completion] = []
        for leader, share in zip(topo.engine_leaders(), shares):
            for c in results[leader]:
                c.prompt_index += share.start
                out.append(c)
        return out
