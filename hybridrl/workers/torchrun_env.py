"""What torchrun tells each process it starts about the run's layout, read from the environment.

torchrun (and launchers that imitate it: `srun torchrun`, Kubeflow's PyTorchJob) start one process per device and
export::

    RANK, WORLD_SIZE               this process's global rank; all processes
    LOCAL_RANK, LOCAL_WORLD_SIZE   its place on this node; processes per node (--nproc_per_node)
    GROUP_WORLD_SIZE               nodes (torchrun's agents, --nnodes)
    MASTER_ADDR, MASTER_PORT       the rendezvous store (torchrun's agent store on the first node)

`cluster=torchrun` takes `cluster.nnodes` and `cluster.workers_per_node` from these (conf/cluster/torchrun.yaml),
and `check_launch` refuses, when the config is validated, a layout that disagrees with the launcher's
(`check_not_launched`: another cluster kind under torchrun, when the workers are started).
Plain environment parsing: no torch here, so the config and the app's entry point can ask it cheaply.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from hybridrl.errors import ConfigError

#: What cluster=torchrun needs from its launcher.
REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

COMMAND = "torchrun --nnodes N --nproc_per_node G -m hybridrl cluster=torchrun ..."


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in a torchrun-style launch."""

    rank: int
    """Global rank (0 runs the controller and its own worker)."""
    world_size: int
    """Processes in the run, one per device."""
    local_rank: int
    """Place on this node (the device index)."""
    local_world_size: int
    """Processes on each node."""
    master_addr: str
    """Host of the rendezvous store."""
    master_port: int
    """Port of the rendezvous store."""
    attempt: int = 0
    """torchrun's restart count (TORCHELASTIC_RESTART_COUNT): keys this run writes to the store are per attempt."""


def launched_rank(environ: Mapping[str, str] = os.environ) -> int | None:
    """This process's RANK when a launcher started it as one of a world (RANK and WORLD_SIZE set), else None."""
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    try:
        return int(environ["RANK"])
    except ValueError:
        return None


def started_by_torchrun(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether torchrun itself started this process (it always sets TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" in environ


def read_launch_env(environ: Mapping[str, str] = os.environ) -> LaunchEnv:
    """The launcher's variables, or a ConfigError naming the ones missing or malformed."""
    missing = [k for k in REQUIRED if not environ.get(k)]
    if missing:
        raise ConfigError(
            f"cluster=torchrun is started by torchrun, which sets {', '.join(REQUIRED)}; {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set here. Run: {COMMAND} (cluster=local runs several "
            "workers from one plain `python -m hybridrl`)"
        )
    values = {}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        try:
            values[key] = int(environ.get(key, "0"))
        except ValueError:
            raise ConfigError(f"environment variable {key}={environ[key]!r} is not an integer") from None
    env = LaunchEnv(
        rank=values["RANK"],
        world_size=values["WORLD_SIZE"],
        local_rank=values["LOCAL_RANK"],
        local_world_size=values["LOCAL_WORLD_SIZE"],
        master_addr=environ["MASTER_ADDR"],
        master_port=values["MASTER_PORT"],
        attempt=values["TORCHELASTIC_RESTART_COUNT"],
    )
    if not 0 <= env.rank < env.world_size or not 0 <= env.local_rank < env.local_world_size:
        raise ConfigError(
            f"the launcher's layout is inconsistent: RANK={env.rank} of WORLD_SIZE={env.world_size}, "
            f"LOCAL_RANK={env.local_rank} of LOCAL_WORLD_SIZE={env.local_world_size}"
        )
    return env


def check_launch(nnodes: int, workers_per_node: int, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse a cluster=torchrun layout the launcher did not start: no launcher at all, or a world of another size."""
    env = read_launch_env(environ)
    if env.local_world_size != workers_per_node:
        raise ConfigError(
            f"cluster.workers_per_node={workers_per_node}, but the launcher started LOCAL_WORLD_SIZE="
            f"{env.local_world_size} processes on this node (torchrun --nproc_per_node); leave "
            "cluster.workers_per_node unset under torchrun, it follows the launcher"
        )
    if env.world_size != nnodes * workers_per_node:
        raise ConfigError(
            f"cluster.nnodes={nnodes} × cluster.workers_per_node={workers_per_node} = {nnodes * workers_per_node} "
            f"workers, but the launcher started WORLD_SIZE={env.world_size} processes (torchrun --nnodes "
            "--nproc_per_node); leave cluster.nnodes unset under torchrun (it follows GROUP_WORLD_SIZE), or set it "
            "to the number of nodes where the launcher does not export GROUP_WORLD_SIZE"
        )


def check_not_launched(name: str, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse another cluster kind in a process torchrun started as one of several: every rank would run a job of
    its own."""
    if name != "torchrun" and started_by_torchrun(environ) and environ.get("WORLD_SIZE", "1") not in ("", "1"):
        raise ConfigError(
            f"torchrun started this process as rank {environ.get('RANK')} of {environ.get('WORLD_SIZE')}, but "
            f"cluster={name}: every rank would run a job of its own. Add cluster=torchrun ({COMMAND})"
        )
