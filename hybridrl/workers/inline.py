"""`cluster=inline`: the one worker lives inside the controller's process (the default on CPU or one GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridrl.phases import Phase
from hybridrl.workers.group import WorkerGroup
from hybridrl.workers.worker import HybridWorker


class InlineWorkerGroup(WorkerGroup):
    """One worker inside the controller process (the default on CPU or one GPU, and in tests)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg.topology())
        self.worker: Any = HybridWorker(cfg, rank=0, world_size=1, local_rank=0)

    def run(self, phase: Phase, per_rank_args: Sequence[tuple] | None = None, **kwargs: Any) -> list[Any]:
        args = per_rank_args[0] if per_rank_args else ()
        return [getattr(self.worker, Phase(phase).value)(*args, **kwargs)]

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
