"""`cluster=torchrun`: every process torchrun starts is a worker; rank 0 also runs the controller and drives the
others with phase commands over a gloo control plane (workers/control.py).

    torchrun --nnodes N --nproc_per_node G -m hybridrl cluster=torchrun ...
        rank 0:  the Hydra app → Controller → TorchrunWorkerGroup: its own worker on a thread, a link per rank
        rank r:  workers/follower.py: compose the same config, join, answer commands until shut down

Start-up, then one phase command::

    join the compute group (NCCL on GPU, gloo on CPU; torchrun's rendezvous) → the gloo pair groups [0, r]
    every rank: compare its composed config with rank 0's → build its HybridWorker (collective)
    run: every link and the worker thread get the command, same order → answers on one queue, with a deadline
         → results in rank order, or WorkerFailure naming the rank and the phase (then all are stopped)

When a rank dies torchrun's agent stops every rank on its node with SIGTERM; rank 0 keeps that signal for
itself so it can still say which rank died first (its link broke before the signal came).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.phases import Phase
from hybridrl.workers.control import (
    CHECK_CONFIG,
    INIT,
    NCCL_ERROR_HANDLING,
    SHUTDOWN,
    PeerLink,
    StopSignal,
    WorkerHost,
    WorkerThread,
    link_timeout_s,
)
from hybridrl.workers.dist import init_process_group, pick_device
from hybridrl.workers.errors import WorkerFailure, raised_message
from hybridrl.workers.failures import FAILURE_GRACE_S, STARTUP_S, Answers, Failure, phase_deadline_s
from hybridrl.workers.group import WorkerGroup
from hybridrl.workers.process import reward_modules
from hybridrl.workers.torchrun_env import read_launch_env

log = logging.getLogger("hybridrl")


def sigterm_message(phase: str | None) -> str:
    """Why the run ends when the launcher stops it and no rank was seen failing first."""
    during = f" during {phase!r}" if phase else ""
    return (
        f"stopped by SIGTERM{during}: torchrun stops every rank when one fails (its report names the rank) or when "
        "the job is cancelled"
    )


class TorchrunWorkerGroup(WorkerGroup):
    """Rank 0's side of a torchrun launch: its own worker on a thread, one link to each other rank."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg.topology())
        self.env = read_launch_env()
        if self.env.rank != 0:
            raise HybridRLError(f"the torchrun worker group runs on rank 0; this is rank {self.env.rank}")
        if self.env.world_size != self.world_size:
            raise ConfigError(
                f"the config asks for {self.world_size} workers, torchrun started WORLD_SIZE={self.env.world_size}"
            )
        self.timeout_s = cfg.cluster.collective_timeout_s
        self.deadline_s = phase_deadline_s(self.timeout_s)
        self.events: queue.Queue = queue.Queue()
        self.channels: list[Any] = []
        self.info: list[tuple[int, str]] = []
        self.stop_signal: StopSignal | None = None
        self.closed = False
        self.waiting = False
        self.terminated_at: float | None = None
        self._seq = itertools.count()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)  # kept until the process ends (workers/follower.py: leave)
        try:
            self._start(cfg)
        except BaseException:
            self.shutdown(grace_s=3.0)
            raise

    def _start(self, cfg) -> None:
        os.environ.update(NCCL_ERROR_HANDLING)
        device = pick_device(cfg.trainer.device, self.env.local_rank)
        init_process_group(0, self.world_size, device, self.timeout_s)
        groups = self.topology.control_groups(link_timeout_s(self.timeout_s))
        self.stop_signal = StopSignal(self.env)

        def make_worker():
            from hybridrl.workers.worker import HybridWorker

            return HybridWorker(cfg, rank=0, world_size=self.world_size, local_rank=self.env.local_rank)

        self.channels = [WorkerThread(WorkerHost(make_worker), self.events)]
        self.channels += [PeerLink(r, groups[r], self.events) for r in range(1, self.world_size)]
        self._command("init", CHECK_CONFIG, [(cfg,)] * self.world_size, {}, self.deadline_s)
        modules = [(reward_modules(),)] * self.world_size
        self.info = self._command("init", INIT, modules, {}, self.deadline_s + STARTUP_S)
        log.info("torchrun workers: %s", ", ".join(f"rank {r} pid {p} on {h}" for r, (p, h) in enumerate(self.info)))

    # -- commands ---------------------------------------------------------------------------
    def run(self, phase: Phase, per_rank_args: Sequence[tuple] | None = None, **kwargs: Any) -> list[Any]:
        if self.closed:
            raise WorkerFailure(f"cannot run {str(phase)!r}: the worker group has shut down", phase=str(phase))
        args = [tuple(per_rank_args[r]) if per_rank_args else () for r in range(self.world_size)]
        try:
            return self._command(str(phase), Phase(phase).value, args, kwargs, self.deadline_s)
        except KeyboardInterrupt:
            self.shutdown(grace_s=3.0)
            raise

    def _command(self, phase: str, name: str, per_rank_args: list[tuple], kwargs: dict, deadline_s: float) -> list:
        """Send `name` to every rank (rank r with `per_rank_args[r]`) and collect the answers."""
        if self.terminated_at is not None:
            self._stop()
            raise WorkerFailure(sigterm_message(phase), phase=phase)
        seq = next(self._seq)
        for rank, channel in enumerate(self.channels):
            channel.submit(seq, name, per_rank_args[rank], kwargs)
        return self._collect(phase, seq, deadline_s)

    def _collect(self, phase: str, seq: int, deadline_s: float) -> list[Any]:
        """Every rank's answer in rank order, through the shared failure path."""
        answers = Answers(phase, self.world_size, deadline_s, self.timeout_s)
        self.waiting = True
        try:
            while answers.waiting():
                if self._stopped_by_launcher(answers):
                    break
                try:
                    got, rank, kind, value, tb = self.events.get(timeout=max(0.0, min(0.25, answers.remaining())))
                except queue.Empty:
                    continue
                if got != seq or rank not in answers.pending:
                    continue  # a late answer to a command already given up on
                if kind == "ok":
                    answers.ok(rank, value)
                elif kind == "raised":
                    answers.failed(Failure("raised", rank, raised_message(rank, phase, value), tb))
                elif self._stopped_with_the_others(rank):
                    answers.pending.discard(rank)
                    log.warning("also: worker rank %d stopped during %r (the launcher's SIGTERM)", rank, phase)
                else:
                    answers.failed(Failure("died", rank, self._died_message(rank, phase, value)))
        finally:
            self.waiting = False
        if self.terminated_at is not None and not answers.failures:
            self._stop()
            raise WorkerFailure(sigterm_message(phase), phase=phase)
        return answers.results(on_failure=self._stop)

    def _stopped_with_the_others(self, rank: int) -> bool:
        """Rank `rank`'s link broke after the launcher's SIGTERM: it was stopped with every rank, not a cause. A link
        that broke before the signal belongs to the rank whose death made the launcher stop the others, even when
        the signal is handled before its event is read."""
        if self.terminated_at is None:
            return False
        broken_at = self.channels[rank].broken_at
        return broken_at is None or broken_at >= self.terminated_at

    def _stopped_by_launcher(self, answers: Answers) -> bool:
        """The launcher's SIGTERM came and, a short grace later, still no rank was seen failing."""
        return (
            self.terminated_at is not None
            and not answers.failures
            and time.monotonic() - self.terminated_at > FAILURE_GRACE_S
        )

    def _died_message(self, rank: int, phase: str, reason: str) -> str:
        where = f"pid {self.info[rank][0]} on {self.info[rank][1]}" if rank < len(self.info) else "starting"
        log.info("worker rank %d: %s", rank, reason)
        return f"worker rank {rank} died during {phase!r} ({where}: its connection closed)"

    def _on_sigterm(self, signum, frame) -> None:
        """torchrun's agent stops every rank when one fails: note it; outside a command, end the run at once (after
        the shutdown, the run is ending already and the app is saying why)."""
        if self.terminated_at is None:
            self.terminated_at = time.monotonic()
        if not self.waiting and not self.closed:
            raise WorkerFailure(sigterm_message(None))

    def _stop(self) -> None:
        self.shutdown(grace_s=5.0)

    # -- teardown ---------------------------------------------------------------------------
    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop every rank that can still listen, then tell the others through the store; safe to call twice.

        Followers first: rank 0's own worker leaves the process groups last, and not at all while a link still
        waits on a silent follower (its process ends soon after anyway)."""
        if self.closed:
            return
        self.closed = True  # from now on the launcher's SIGTERM is noted only: the app is printing why it ends
        followers = [ch for ch in self.channels[1:] if not ch.broken and not ch.busy]
        self._farewell(followers, grace_s)
        if self.stop_signal is not None:
            try:
                self.stop_signal.set()  # a follower stuck in a phase leaves through its watchdog
            except Exception:  # noqa: BLE001 - the store's host may be gone already
                pass
        own = self.channels[:1]
        if own and not own[0].busy and not any(ch.busy for ch in self.channels[1:]):
            self._farewell(own, grace_s)
        for ch in self.channels:
            ch.close()

    def _farewell(self, channels: list, grace_s: float) -> None:
        """SHUTDOWN to `channels`; wait up to `grace_s` for their acknowledgements, whatever they say."""
        if not channels:
            return
        seq = next(self._seq)
        for ch in channels:
            ch.submit(seq, SHUTDOWN)
        left, end = len(channels), time.monotonic() + grace_s
        while left and time.monotonic() < end:
            try:
                got = self.events.get(timeout=max(0.0, min(0.25, end - time.monotonic())))
            except queue.Empty:
                continue
            left -= got[0] == seq
