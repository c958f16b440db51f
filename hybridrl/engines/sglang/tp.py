"""The engine TP group seen from one worker: its CPU (gloo) process group and leader-centred collectives.

The groups come from the run's `Topology` (`tp_size` consecutive ranks). Only the leader (TP rank 0) owns the SGLang
Engine; the others send it their inputs (`gather`), wait for its result or its error (`broadcast`) and take their
share of the outputs (`scatter`). Small Python objects only travel here (token ids, base64 payloads of a few hundred
bytes on a GPU), so a gloo group is used even when the default group is NCCL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from hybridrl.errors import HybridRLError
from hybridrl.topology import Topology

T = TypeVar("T")


class TpGroup:
    """One engine TP group's CPU collectives (no-ops for a TP group of one)."""

    def __init__(self, topology: Topology) -> None:
        """Must run on every rank at the same time: the topology creates the gloo TP groups on first use, which is
        collective over the default group."""
        self.tp_rank, self.tp_size = topology.engine_tp_rank, topology.engine_tp_size
        self.ranks = topology.engine_tp_ranks
        self.group: dist.ProcessGroup | None = None
        if self.tp_size == 1:
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise HybridRLError(
                f"engine.tp_size={self.tp_size} needs torch.distributed initialized by the worker "
                "(one process per TP rank); none is"
            )
        self.group = topology.engine_tp_group(backend="gloo")

    @property
    def is_leader(self) -> bool:
        """Whether this rank owns the engine."""
        return self.tp_rank == 0

    @property
    def leader(self) -> int:
        """Global rank of the leader."""
        return self.ranks[0]

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's `obj` in TP-rank order on the leader; None elsewhere."""
        if self.group is None:
            return [obj]
        out: list[Any] | None = [None] * self.tp_size if self.is_leader else None
        dist.gather_object(obj, out, group=self.group, group_dst=0)
        return out

    def scatter(self, objs: list[T] | None) -> T:
        """The leader's `objs[r]` on TP rank r (`objs` is ignored off the leader)."""
        if self.group is None:
            return objs[0]
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.is_leader else None, group=self.group, group_src=0)
        return out[0]

    def broadcast(self, obj: T | None) -> T:
        """The leader's `obj` on every rank."""
        if self.group is None:
            return obj
        box = [obj if self.is_leader else None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank of the TP group is here."""
        if self.group is not None:
            dist.barrier(group=self.group)

    def on_leader(self, what: str, fn: Callable[[], T]) -> T:
        """Run `fn` on the leader and hand its result (or its failure) to every rank.

        The broadcast doubles as a barrier: no rank returns before the leader's call finished, so a rank never
        frees a buffer the engine still reads, nor reuses memory the engine has not released yet. A failure
        raises HybridRLError on every rank instead of leaving the others waiting in the next collective.
        """
        status: tuple[bool, Any] | None = None
        error: BaseException | None = None
        if self.is_leader:
            try:
                status = (True, fn())
            except Exception as exc:  # noqa: BLE001 -- re-raised on every rank below
                error = exc
                status = (False, f"{type(exc).__name__}: {exc}")
        ok, value = self.broadcast(status)
        if not ok:
            raise HybridRLError(
                f"SGLang engine: {what} failed on the TP leader (rank {self.leader}): {value}"
            ) from error
        return value
