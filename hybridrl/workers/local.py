"""`cluster=local`: N worker processes on this node, one per device, driven over pipes.

One phase command, as the controller's `run` issues it::

    for each rank: pipe.send((phase, args, kwargs))        # every rank, same order
    wait(pipes + process sentinels, deadline)               # answers, deaths, or the clock  (workers/failures.py)
    → results in rank order, or WorkerFailure naming the rank and the phase (then all are stopped)

The workers meet through a rendezvous file in a private folder of this process (`torch.distributed.FileStore`):
no TCP port is opened for it. Their log records come back through a `multiprocessing` queue
(`logging.handlers.QueueHandler` there, a `QueueListener` here) into the controller's handlers. A worker dies
with its controller (PR_SET_PDEATHSIG on Linux, else a watchdog thread), ignores Ctrl-C, and runs in a session of
its own, so a SIGTERM sent to the controller's process group reaches only the controller: the controller decides,
stops the workers and removes the rendezvous folder, whether the run ends by an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.phases import Phase
from hybridrl.workers.dist import STORE_FILE_ENV
from hybridrl.workers.errors import WorkerFailure, died_message, raised_message
from hybridrl.workers.failures import STARTUP_S, Answers, Failure, error_summary, phase_deadline_s, raise_failure
from hybridrl.workers.group import WorkerGroup
from hybridrl.workers.process import prepare_worker_process, reward_modules

log = logging.getLogger("hybridrl")

SHUTDOWN = "__shutdown__"


class _Channel:
    """One pipe end carrying whole pickled messages.

    Plain pickle, not the Connection's ForkingPickler: torch registers shared-memory reductions there, which would
    tie a result's tensors to the sender's lifetime.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, msg: tuple) -> None:
        self.conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))  # fails before any byte is sent

    def recv(self) -> Any:
        return pickle.loads(self.conn.recv_bytes())


class _RankPrefix(logging.Filter):
    """`[rank 1] message`, so the controller's log says which worker spoke."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.prefix = f"[rank {rank}] "

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self.prefix + record.getMessage()
        record.args = None
        return True


class _ToLogger(logging.Handler):
    """Hands a forwarded record to the controller's logger of the same name (console and run log)."""

    def emit(self, record: logging.LogRecord) -> None:
        logger = logging.getLogger(record.name)
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)


def _exit_with_parent(parent_pid: int) -> None:
    """Die when the controller dies, even in the middle of a phase."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
            if os.getppid() != parent_pid:  # it died before prctl took effect
                os._exit(1)
            return
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="hybridrl-parent-watch").start()


def _worker_main(
    conn: Connection,
    log_queue,
    cfg,
    rank: int,
    world_size: int,
    env: dict[str, str],
    parent_pid: int,
    log_level: int,
    modules: list[str],
) -> None:
    """A worker process: build the HybridWorker, then answer commands until shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setsid()  # out of the controller's process group: a group-wide SIGTERM is the controller's to handle
    _exit_with_parent(parent_pid)
    os.environ.update(env)
    channel = _Channel(conn)
    forward = logging.handlers.QueueHandler(log_queue)
    forward.addFilter(_RankPrefix(rank))
    forward.setLevel(log_level if rank == 0 else max(log_level, logging.WARNING))
    root = logging.getLogger()
    root.handlers[:] = [forward]
    root.setLevel(log_level)
    try:
        prepare_worker_process(modules)
        from hybridrl.workers.worker import HybridWorker

        worker = HybridWorker(cfg, rank=rank, world_size=world_size, local_rank=rank)
        channel.send(("ok", os.getpid()))
    except BaseException as e:  # noqa: BLE001 - report anything, then leave
        _send_error(channel, e)
        _exit(1, log_queue)
    while True:
        try:
            phase, args, kwargs = channel.recv()
        except (EOFError, OSError):
            break  # the controller is gone
        if phase == SHUTDOWN:
            break
        try:
            channel.send(("ok", getattr(worker, Phase(phase).value)(*args, **kwargs)))
        except Exception as e:  # noqa: BLE001 - the controller decides what a failure means
            _send_error(channel, e)
    try:
        worker.shutdown()
    except Exception:  # noqa: BLE001 - leaving anyway
        pass
    _exit(0, log_queue)


def _exit(code: int, log_queue) -> None:
    """Leave without the interpreter's teardown, which can abort in DeviceMesh/DTensor (PLATFORM_FACTS), after the
    log records still buffered in this process reach the controller."""
    log_queue.close()
    log_queue.join_thread()
    os._exit(code)


def _send_error(channel: _Channel, exc: BaseException) -> None:
    """The error's one-line summary, its traceback, and whether it is a user error (a HybridRLError, whose message
    says what to change: its traceback is not printed)."""
    try:
        channel.send(("error", error_summary(exc), traceback.format_exc(), isinstance(exc, HybridRLError)))
    except Exception:  # noqa: BLE001
        pass


class LocalWorkerGroup(WorkerGroup):
    """`cluster.workers_per_node` worker processes on this node, one torch.distributed group."""

    def __init__(self, cfg) -> None:
        if cfg.cluster.nnodes != 1:
            raise ConfigError(
                f"cluster=local runs on one node, got cluster.nnodes={cfg.cluster.nnodes}; use cluster=ray for several"
            )
        super().__init__(cfg.topology())
        self.timeout_s = cfg.cluster.collective_timeout_s
        self.deadline_s = phase_deadline_s(self.timeout_s)
        self.procs: list[mp.Process] = []
        self.channels: list[_Channel] = []
        self.closed = False
        self.rendezvous = tempfile.mkdtemp(prefix="hybridrl-rdzv-")  # mode 0700: this user only
        ctx = mp.get_context("spawn")
        self.log_queue = ctx.Queue()
        self.listener = logging.handlers.QueueListener(self.log_queue, _ToLogger())
        self.listener.start()
        atexit.register(self.shutdown)
        env = {STORE_FILE_ENV: os.path.join(self.rendezvous, "store")}
        level, modules = log.getEffectiveLevel(), reward_modules()
        try:
            for rank in range(self.world_size):
                ours, theirs = ctx.Pipe(duplex=True)
                rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.world_size))
                proc = ctx.Process(
                    target=_worker_main,
                    name=f"hybridrl-worker-{rank}",
                    daemon=False,
                    args=(theirs, self.log_queue, cfg, rank, self.world_size, rank_env, os.getpid(), level, modules),
                )
                # A Ctrl-C while the workers start is the controller's to handle: the child must not see it
                # before its own handler (SIG_IGN) is installed, or every rank prints a traceback.
                previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
                try:
                    proc.start()
                finally:
                    signal.signal(signal.SIGINT, previous)
                theirs.close()
                self.procs.append(proc)
                self.channels.append(_Channel(ours))
            log.info("local workers: %s", ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(self.procs)))
            self._collect("init", self.deadline_s + STARTUP_S)
        except BaseException:
            self.shutdown(grace_s=3.0)
            raise

    # -- commands ---------------------------------------------------------------------------
    def run(self, phase: Phase, per_rank_args: Sequence[tuple] | None = None, **kwargs: Any) -> list[Any]:
        if self.closed:
            raise WorkerFailure(f"cannot run {str(phase)!r}: the worker group has shut down", phase=str(phase))
        try:
            dead: list[Failure] = []
            for rank, ch in enumerate(self.channels):
                args = tuple(per_rank_args[rank]) if per_rank_args else ()
                try:
                    ch.send((Phase(phase).value, args, kwargs))
                except OSError:  # its end of the pipe is closed: it died
                    self.procs[rank].join(1.0)
                    dead.append(Failure("died", rank, died_message(rank, str(phase), self.procs[rank].exitcode)))
            if dead:
                raise_failure(str(phase), dead, on_failure=lambda: self.shutdown(grace_s=5.0))
            return self._collect(str(phase), self.deadline_s)
        except KeyboardInterrupt:
            self.shutdown(grace_s=3.0)
            raise

    def _collect(self, phase: str, deadline_s: float) -> list[Any]:
        """Every rank's answer in rank order, through the shared failure path."""
        answers = Answers(phase, self.world_size, deadline_s, self.timeout_s)
        while answers.waiting():
            waiting: dict[Any, int] = {}
            for r in answers.pending:
                waiting[self.channels[r].conn] = r
                waiting[self.procs[r].sentinel] = r
            for obj in wait(list(waiting), timeout=answers.remaining()):
                r = waiting[obj]
                if r not in answers.pending:
                    continue
                conn = self.channels[r].conn
                if obj is not conn and conn.poll():
                    continue  # it answered before it exited: read the answer first
                msg = None
                if obj is conn:
                    try:
                        msg = self.channels[r].recv()
                    except (EOFError, OSError):
                        msg = None
                if msg is not None and msg[0] == "ok":
                    answers.ok(r, msg[1])
                elif msg is not None:
                    trace = None if len(msg) > 3 and msg[3] else msg[2]
                    answers.failed(Failure("raised", r, raised_message(r, phase, msg[1]), trace))
                else:
                    self.procs[r].join(1.0)
                    answers.failed(Failure("died", r, died_message(r, phase, self.procs[r].exitcode)))
        return answers.results(on_failure=lambda: self.shutdown(grace_s=5.0))

    # -- teardown ---------------------------------------------------------------------------
    def shutdown(self, grace_s: float = 30.0) -> None:
        """Ask every worker to stop, then terminate, then kill what is left; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.shutdown)
        for ch, proc in zip(self.channels, self.procs):
            if proc.is_alive():
                try:
                    ch.send((SHUTDOWN, (), {}))
                except OSError:
                    pass
        self._join(grace_s)
        for step in ("terminate", "kill"):
            alive = [p for p in self.procs if p.is_alive()]
            if not alive:
                break
            log.warning("%s worker pid(s) %s", step, ", ".join(str(p.pid) for p in alive))
            for p in alive:
                getattr(p, step)()
            self._join(3.0)
        for ch in self.channels:
            ch.conn.close()
        self.listener.stop()  # writes the records still queued
        self.log_queue.close()
        shutil.rmtree(self.rendezvous, ignore_errors=True)

    def _join(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
