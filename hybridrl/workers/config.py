"""Config of the process layout (`cluster=inline|local|torchrun|ray`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hybridrl.errors import ConfigError
from hybridrl.workers.torchrun_env import check_launch


@dataclass
class ClusterConfig:
    """How many workers run where, and how they talk."""

    name: str = "inline"
    """inline (one worker in the controller process), local (N processes on this node), torchrun (every process
    started by torchrun, rank 0 the controller's) or ray (actors on a Ray cluster)."""
    workers_per_node: int = 1
    """Worker processes per node, one per device."""
    nnodes: int = 1
    """Nodes (ray and torchrun; under torchrun it follows the launcher's GROUP_WORLD_SIZE)."""
    collective_timeout_s: float = 600.0
    """A collective or phase command taking longer than this becomes an error naming the phase and rank."""
    cpu_threads: Optional[int] = None
    """torch intra-op threads per worker on CPU; None = OMP_NUM_THREADS if set, else 1 for a model under 20M
    parameters, else the cores divided among this node's workers."""
    ray_address: Optional[str] = None
    """Address of an existing Ray cluster (ray start --head); None starts a local one."""

    def __post_init__(self) -> None:
        if self.name not in ("inline", "local", "torchrun", "ray"):
            raise ConfigError(f"cluster.name must be inline, local, torchrun or ray, got {self.name!r}")
        if self.workers_per_node < 1:
            raise ConfigError(f"cluster.workers_per_node must be >= 1, got {self.workers_per_node}")
        if self.nnodes < 1:
            raise ConfigError(f"cluster.nnodes must be >= 1, got {self.nnodes}")
        if self.name == "inline" and self.workers_per_node * self.nnodes != 1:
            raise ConfigError(
                "cluster=inline runs exactly one worker; use cluster=local for cluster.workers_per_node > 1"
            )
        if self.name == "local" and self.nnodes != 1:
            raise ConfigError(
                f"cluster=local runs on one node, got cluster.nnodes={self.nnodes}; use cluster=torchrun or cluster=ray"
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(
                f"cluster.cpu_threads must be >= 1 (or null for the automatic choice), got {self.cpu_threads}"
            )
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"cluster.collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if self.name == "torchrun":
            check_launch(self.nnodes, self.workers_per_node)

    @property
    def world_size(self) -> int:
        return self.workers_per_node * self.nnodes
