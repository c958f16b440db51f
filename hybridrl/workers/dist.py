"""torch.distributed set-up for a worker: one process group over all workers (NCCL on GPU, gloo on CPU)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def pick_device(requested: str, local_rank: int) -> torch.device:
    """`trainer.device` resolved: auto takes this worker's GPU when there is one, else the CPU."""
    use_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


#: A rendezvous file shared by the workers of one node (`cluster=local`): a store that needs no TCP port.
STORE_FILE_ENV = "HYBRIDRL_STORE_FILE"


def init_process_group(rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
    """Join the workers' default group: through the file named by $HYBRIDRL_STORE_FILE (local workers), the
    MASTER_ADDR/PORT rendezvous (Ray, torchrun), or an in-memory store for a lone worker (no port to pick)."""
    if dist.is_initialized():
        return
    if device.type == "cuda" and device.index is None:  # NCCL binds one device: "cuda" means the current one
        device = torch.device("cuda", torch.cuda.current_device())
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if os.environ.get(STORE_FILE_ENV):
        store = dist.FileStore(os.environ[STORE_FILE_ENV], world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    elif world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs)
    else:
        dist.init_process_group(
            backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout, **kwargs
        )


def memory_snapshot(device: torch.device, mapped: int = 0) -> dict[str, float]:
    """Memory in use now, in GiB: allocated/reserved on a GPU, torch's allocator plus `mapped` (the bytes the engine
    maps itself outside it, `RolloutEngine.mapped_bytes`; also given alone as fixed_gb); resident set size on the
    CPU."""
    if device.type == "cuda":
        return {
            "allocated_gb": (torch.cuda.memory_allocated(device) + mapped) / 2**30,
            "reserved_gb": (torch.cuda.memory_reserved(device) + mapped) / 2**30,
            "fixed_gb": mapped / 2**30,
        }
    try:
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        return {"rss_gb": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**30}
    except (OSError, ValueError):
        return {}
