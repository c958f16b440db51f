"""The worker-group backend `cluster.name` selects: inline (in this process), local (processes), torchrun (the
processes torchrun started), ray (actors)."""

from __future__ import annotations

from hybridrl.workers.group import WorkerGroup
from hybridrl.workers.torchrun_env import check_not_launched


def build_worker_group(cfg) -> WorkerGroup:
    """Start the workers of `cluster.name` for `cfg` (Ray is imported only when asked for)."""
    check_not_launched(cfg.cluster.name)
    if cfg.cluster.name == "inline":
        from hybridrl.workers.inline import InlineWorkerGroup

        return InlineWorkerGroup(cfg)
    if cfg.cluster.name == "local":
        from hybridrl.workers.local import LocalWorkerGroup

        return LocalWorkerGroup(cfg)
    if cfg.cluster.name == "torchrun":
        from hybridrl.workers.torchrun import TorchrunWorkerGroup

        return TorchrunWorkerGroup(cfg)
    from hybridrl.workers.ray_group import RayWorkerGroup

    return RayWorkerGroup(cfg)
