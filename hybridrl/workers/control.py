"""The control plane of `cluster=torchrun`: phase commands and their answers between rank 0 and every other rank, as
pickled messages over gloo (CPU, TCP), beside the compute group (NCCL on GPU, gloo on CPU)::

    rank 0 (controller)                                   rank r (follower)
    PeerLink r ── pair group [0, r] ── command ────────►  recv → HybridWorker.<phase>(...) → send
                  (Topology.control_groups)
               ◄─────────────────────── answer ────────
    WorkerThread: rank 0's own HybridWorker, on a thread of its own

    both put (command number, rank, "ok" | "raised" | "died", value, traceback) on one queue the controller waits on

One group of two per follower: a rank that dies breaks only its own link, and rank 0 learns which rank it was from the
link that fails (gloo reports a closed connection at once), however the compute group fares. Rank 0's worker runs
on its own thread so the controller keeps its deadlines while that worker waits inside a collective.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.phases import Phase
from hybridrl.workers.failures import STARTUP_S, error_summary, phase_deadline_s
from hybridrl.workers.process import prepare_worker_process
from hybridrl.workers.torchrun_env import LaunchEnv

log = logging.getLogger("hybridrl")

CHECK_CONFIG = "__check_config__"  # a follower compares its own composed config with rank 0's
INIT = "__init__"  # build the HybridWorker (collective: every rank at once)
SHUTDOWN = "__shutdown__"  # answer, then leave

#: NCCL's error handling on every torchrun rank: a collective that times out raises in the worker (whose rank the
#: controller then names) instead of tearing the process down, which on rank 0 would take the controller with it.
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def link_timeout_s(collective_timeout_s: float) -> float:
    """How long one end of a link waits for the other: past the controller's own deadlines (a phase, or a worker's
    start-up), which decide first; a follower waiting this long for its next command concludes rank 0 is gone."""
    return phase_deadline_s(collective_timeout_s) + STARTUP_S + 60.0


def send_message(msg: Any, peer: int, group: Any) -> None:
    """One pickled message to global rank `peer`: its length, then its bytes.

    Plain pickle, as the local backend's pipes: a tensor travels as a copy of its data."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=peer, group=group)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=peer, group=group)


def recv_message(peer: int, group: Any) -> Any:
    """The next message from global rank `peer` (raises when the link breaks or the group's timeout passes)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=peer, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src=peer, group=group)
    return pickle.loads(data.numpy().tobytes())


def whereabouts() -> tuple[int, str]:
    """(pid, host name): how the log and the failure messages point at a rank."""
    return os.getpid(), socket.gethostname()


class WorkerHost:
    """Runs commands on this rank's HybridWorker: the follower's main loop and rank 0's WorkerThread share it."""

    def __init__(self, make_worker: Callable[[], Any]) -> None:
        self.make_worker = make_worker
        self.worker: Any = None

    def handle(self, name: str, args: tuple, kwargs: dict) -> Any:
        """Run one command; what it returns is the answer's value."""
        if name == INIT:  # args: the modules that registered rank 0's rewards
            prepare_worker_process(*args)
            self.worker = self.make_worker()
            return whereabouts()
        return getattr(self.worker, Phase(name).value)(*args, **kwargs)

    def shutdown(self) -> None:
        """Release the engine and leave the process group (a worker never built has nothing to release)."""
        if self.worker is not None:
            worker, self.worker = self.worker, None
            worker.shutdown()


class PeerLink:
    """Rank 0's end of the link to follower `rank`: a thread that sends each command and waits for its answer."""

    def __init__(self, rank: int, group: Any, events: queue.Queue) -> None:
        self.rank, self.group, self.events = rank, group, events
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.broken_at: float | None = None
        """When the connection broke (time.monotonic()): told apart from the launcher's SIGTERM by time, not by when
        the controller reads the event."""
        self.busy = False  # between sending a command and its answer
        self.thread = threading.Thread(target=self._serve, daemon=True, name=f"hybridrl-link-{rank}")
        self.thread.start()

    @property
    def broken(self) -> bool:
        """Whether the follower is gone (the link's thread has ended)."""
        return self.broken_at is not None

    def submit(self, seq: int, name: str, args: tuple = (), kwargs: dict | None = None) -> None:
        """Send command number `seq`; its answer arrives on the events queue."""
        self.inbox.put((seq, (name, args, kwargs or {})))

    def close(self) -> None:
        """Stop the thread once it is idle (one blocked on a silent follower stays so until the process ends)."""
        self.inbox.put(None)

    def _serve(self) -> None:
        while (item := self.inbox.get()) is not None:
            seq, msg = item
            self.busy = True
            try:
                send_message(msg, self.rank, self.group)
                answer = recv_message(self.rank, self.group)
            except Exception as e:  # noqa: BLE001 - a broken connection: the follower is gone
                self.broken_at = time.monotonic()
                self.events.put((seq, self.rank, "died", error_summary(e), None))
                return
            finally:
                self.busy = False
            if answer[0] == "ok":
                self.events.put((seq, self.rank, "ok", answer[1], None))
            else:
                self.events.put((seq, self.rank, "raised", answer[1], answer[2]))


class WorkerThread:
    """Rank 0's own worker on a thread of its own; answers on the same events queue as the links."""

    def __init__(self, host: WorkerHost, events: queue.Queue) -> None:
        self.host, self.events = host, events
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.broken_at: float | None = None  # it cannot break: it lives in this process
        self.busy = False
        self.thread = threading.Thread(target=self._serve, daemon=True, name="hybridrl-worker-0")
        self.thread.start()

    def submit(self, seq: int, name: str, args: tuple = (), kwargs: dict | None = None) -> None:
        """Run command number `seq` on the thread; its answer arrives on the events queue."""
        self.inbox.put((seq, (name, args, kwargs or {})))

    def close(self) -> None:
        """Stop the thread once it is idle."""
        self.inbox.put(None)

    def _serve(self) -> None:
        while (item := self.inbox.get()) is not None:
            seq, (name, args, kwargs) = item
            self.busy = True
            try:
                if name == CHECK_CONFIG:
                    value = None  # rank 0's config is the reference
                elif name == SHUTDOWN:
                    value = self.host.shutdown()
                else:
                    value = self.host.handle(name, args, kwargs)
                self.events.put((seq, 0, "ok", value, None))
            except Exception as e:  # noqa: BLE001 - the controller decides what a failure means
                self.events.put((seq, 0, "raised", error_summary(e), traceback.format_exc()))
            finally:
                self.busy = False


class StopSignal:
    """A key in the launcher's store that rank 0 sets when the run ends: a follower stuck in a phase (it cannot read
    the shutdown command) sees it from its watchdog thread and leaves, on whatever node it runs."""

    def __init__(self, env: LaunchEnv, timeout_s: float = 30.0) -> None:
        self.key = f"hybridrl/stop/{env.attempt}"
        self.store = dist.TCPStore(
            env.master_addr, env.master_port, is_master=False, timeout=timedelta(seconds=timeout_s)
        )

    def set(self) -> None:
        """Tell every rank the run is over."""
        self.store.set(self.key, "1")

    def is_set(self) -> bool:
        """Whether rank 0 ended the run (raises when the store is gone: its host ended too)."""
        return self.store.check([self.key])
