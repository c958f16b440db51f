"""`cluster=local`: N worker processes on this node, one per device, driven over pipes.

One phase command, as the controller's `run` issues it::

    for each rank: pipe.send((method, args, kwargs))       # every rank, same order
    wait(pipes + process sentinels, deadline)              # answers, deaths, or the clock
    → results in rank order, or WorkerFailure naming the rank and the phase (then all are stopped)

The controller hosts the rendezvous TCPStore (port 0, so no port is ever guessed) and the
workers join it as clients, the way torchrun's agent does. A worker dies with its controller
(PR_SET_PDEATHSIG on Linux, else a watchdog thread), and ignores Ctrl-C: the controller decides.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from hybridrl.errors import ConfigError
from hybridrl.workers.errors import WorkerFailure, died_message, raised_message, timeout_message
from hybridrl.workers.group import WorkerGroup

log = logging.getLogger("hybridrl")

SHUTDOWN = "__shutdown__"
FAULT_ENV = "HYBRIDRL_TEST_FAULT"
FAILURE_GRACE_S = 2.0  # after a first failure, how long to listen for the others (to name the cause)
STARTUP_S = 300.0  # start-up (imports, model loading) may take this much longer than a phase


# -- shared with the Ray backend ------------------------------------------------------------
def phase_deadline_s(collective_timeout_s: float) -> float:
    """How long the controller waits for a phase: the workers' own collective timeout fires first."""
    return collective_timeout_s + min(60.0, max(5.0, 0.1 * collective_timeout_s))


def inject_test_fault(rank: int, method: str, nth: int) -> None:
    """TEST ONLY: `HYBRIDRL_TEST_FAULT=<rank>:<method>:<nth call>[:kill|raise|hang]` fails that call."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    r, m, n, mode = (spec.split(":") + ["kill"])[:4]
    if (int(r), m, int(n)) != (rank, method, nth):
        return
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        logging.getLogger("hybridrl").warning("test fault: rank %d hangs in %r", rank, method)
        time.sleep(10**6)
    raise ValueError(f"injected test fault ({FAULT_ENV}={spec})")


def reward_modules() -> list[str]:
    """Modules that registered the rewards known here, so a worker process can register them too."""
    from hybridrl.rewards.registry import registered_rewards, resolve_reward

    mods = {getattr(resolve_reward(name), "__module__", None) for name in registered_rewards()}
    return sorted(m for m in mods if m and m != "__main__")


def prepare_worker_process(modules: Sequence[str], threads: int) -> None:
    """What a fresh worker process needs before a HybridWorker: thread count, rewards, no mp locks."""
    import importlib

    import torch

    torch.set_num_threads(threads)
    for name in modules:
        importlib.import_module(name)
    try:  # tqdm's default lock is a multiprocessing semaphore that an os._exit leaves "leaked"
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())
    except ImportError:
        pass


def error_summary(exc: BaseException) -> str:
    """`ValueError: message` (the last line of the exception, as Python prints it)."""
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


# -- the worker process ---------------------------------------------------------------------
class _Channel:
    """One pipe end; whole pickled messages, and a lock because log records come from any thread.

    Plain pickle, not the Connection's ForkingPickler: torch registers shared-memory reductions
    there, which would tie a result's tensors to the sender's lifetime.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn, self.lock = conn, threading.Lock()

    def send(self, msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)  # fails before any byte is sent
        with self.lock:
            self.conn.send_bytes(data)

    def recv(self) -> Any:
        return pickle.loads(self.conn.recv_bytes())


class _LogForwarder(logging.Handler):
    """Sends a worker's log records to the controller, which writes them to the run's log."""

    def __init__(self, channel: _Channel, rank: int, level: int) -> None:
        super().__init__(level)
        self.channel, self.rank = channel, rank
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.channel.send(("log", record.name, record.levelno, f"[rank {self.rank}] {self.format(record)}"))
        except Exception:  # the controller is gone or the record is broken: never fail the worker for a log
            pass


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
    conn: Connection, cfg, rank: int, world_size: int, env: dict[str, str], parent_pid: int, log_level: int,
    modules: list[str],
) -> None:
    """A worker process: build the HybridWorker, then answer commands until shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(parent_pid)
    os.environ.update(env)
    channel = _Channel(conn)
    root = logging.getLogger()
    root.handlers[:] = [_LogForwarder(channel, rank, log_level if rank == 0 else max(log_level, logging.WARNING))]
    root.setLevel(log_level)
    try:
        # Workers share the CPU cores: oversubscribed threads slow every rank down.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        prepare_worker_process(modules, max(1, cores // world_size))
        from hybridrl.workers.worker import HybridWorker

        inject_test_fault(rank, "init", 1)
        worker = HybridWorker(cfg, rank=rank, world_size=world_size, local_rank=rank)
        channel.send(("ok", os.getpid()))
    except BaseException as e:  # noqa: BLE001 - report anything, then leave
        _send_error(channel, e)
        os._exit(1)
    calls: Counter[str] = Counter()
    while True:
        try:
            method, args, kwargs = channel.recv()
        except (EOFError, OSError):
            break  # the controller is gone
        if method == SHUTDOWN:
            break
        calls[method] += 1
        try:
            inject_test_fault(rank, method, calls[method])
            channel.send(("ok", getattr(worker, method)(*args, **kwargs)))
        except Exception as e:  # noqa: BLE001 - the controller decides what a failure means
            _send_error(channel, e)
    try:
        worker.shutdown()
    except Exception:  # noqa: BLE001 - leaving anyway
        pass
    # A plain exit can abort in DeviceMesh/DTensor teardown; os._exit skips it (PLATFORM_FACTS).
    os._exit(0)


def _send_error(channel: _Channel, exc: BaseException) -> None:
    try:
        channel.send(("error", error_summary(exc), traceback.format_exc()))
    except Exception:  # noqa: BLE001
        pass


# -- the controller's side ------------------------------------------------------------------
class LocalWorkerGroup(WorkerGroup):
    """`cluster.workers_per_node` worker processes on this node, one torch.distributed group."""

    def __init__(self, cfg) -> None:
        if cfg.cluster.nnodes != 1:
            raise ConfigError(
                f"cluster=local runs on one node, got cluster.nnodes={cfg.cluster.nnodes}; use cluster=ray for several"
            )
        super().__init__(world_size=cfg.cluster.world_size, tp_size=cfg.engine.tp_size)
        import torch.distributed as dist

        self.timeout_s = cfg.cluster.collective_timeout_s
        self.deadline_s = phase_deadline_s(self.timeout_s)
        self.procs: list[mp.Process] = []
        self.channels: list[_Channel] = []
        self.closed = False
        # The rendezvous store lives here for the group's lifetime: port 0, so no race for a port.
        self.store = dist.TCPStore(
            "127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=self.timeout_s),
        )
        env = {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port), "WORLD_SIZE": str(self.world_size),
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank a client of the store above
        }
        atexit.register(self.shutdown)
        ctx = mp.get_context("spawn")
        level, modules = log.getEffectiveLevel(), reward_modules()
        try:
            for rank in range(self.world_size):
                ours, theirs = ctx.Pipe(duplex=True)
                rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
                proc = ctx.Process(
                    target=_worker_main, args=(theirs, cfg, rank, self.world_size, rank_env, os.getpid(), level, modules),
                    name=f"hybridrl-worker-{rank}", daemon=False,
                )
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.channels.append(_Channel(ours))
            log.info("local workers: %s", ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(self.procs)))
            self._gather("init", self.deadline_s + STARTUP_S)
        except BaseException:
            self.shutdown()
            raise

    # -- commands ---------------------------------------------------------------------------
    def run(self, method: str, per_rank_args: Sequence[tuple] | None = None, **kwargs: Any) -> list[Any]:
        if self.closed:
            raise WorkerFailure(f"cannot run {method!r}: the worker group has shut down", phase=method)
        try:
            dead: dict[int, int | None] = {}
            for rank, ch in enumerate(self.channels):
                args = tuple(per_rank_args[rank]) if per_rank_args else ()
                try:
                    ch.send((method, args, kwargs))
                except OSError:  # its end of the pipe is closed: it died
                    self.procs[rank].join(1.0)
                    dead[rank] = self.procs[rank].exitcode
            if dead:
                rank = min(dead)
                self._fail(method, [("died", rank, died_message(rank, method, dead[rank]), None)])
            return self._gather(method, self.deadline_s)
        except KeyboardInterrupt:
            self.shutdown(grace_s=3.0)
            raise

    def _gather(self, phase: str, deadline_s: float) -> list[Any]:
        """Answers of every rank, in rank order; the first failure (after a short grace) raises."""
        start = time.monotonic()
        results: dict[int, Any] = {}
        failures: list[tuple[str, int, str, str | None]] = []  # (kind, rank, message, traceback)
        pending = set(range(self.world_size))
        first_failure: float | None = None
        while pending:
            limit = start + deadline_s if first_failure is None else first_failure + FAILURE_GRACE_S
            if time.monotonic() >= limit:
                break
            waiting: dict[Any, int] = {}
            for r in pending:
                waiting[self.channels[r].conn] = r
                waiting[self.procs[r].sentinel] = r
            for obj in wait(list(waiting), timeout=max(0.0, limit - time.monotonic())):
                r = waiting[obj]
                if r not in pending:
                    continue
                conn = self.channels[r].conn
                if obj is not conn and conn.poll():
                    continue  # it answered before it exited: read the answer first
                if obj is conn:
                    try:
                        msg = self.channels[r].recv()
                    except (EOFError, OSError):
                        msg = None
                    if msg is not None and msg[0] == "log":
                        _emit_forwarded(msg)
                        continue
                    if msg is not None and msg[0] == "ok":
                        results[r] = msg[1]
                        pending.discard(r)
                        continue
                    if msg is not None:
                        failures.append(("raised", r, raised_message(r, phase, msg[1]), msg[2]))
                        pending.discard(r)
                        continue
                self.procs[r].join(1.0)
                failures.append(("died", r, died_message(r, phase, self.procs[r].exitcode), None))
                pending.discard(r)
            if failures and first_failure is None:
                first_failure = time.monotonic()
        if failures:
            self._fail(phase, failures)
        if pending:
            ranks = sorted(pending)
            self._fail(phase, [("timeout", ranks[0], timeout_message(ranks, phase, time.monotonic() - start, self.timeout_s), None)])
        return [results[r] for r in range(self.world_size)]

    def _fail(self, phase: str, failures: list[tuple[str, int, str, str | None]]) -> None:
        """Log the cause once, stop every worker, raise. A death outranks the errors it causes in its peers."""
        order = {"died": 0, "raised": 1, "timeout": 2}
        kind, rank, message, tb = min(failures, key=lambda f: order[f[0]])
        if tb:
            log.error("worker rank %d traceback:\n%s", rank, tb.rstrip())
        for f in failures:
            if f[1] != rank:
                log.warning("also: %s", f[2])
        self.shutdown(grace_s=5.0)
        raise WorkerFailure(message, rank=rank, phase=phase)

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
        self._wait_exit(grace_s)
        for sig_step in ("terminate", "kill"):
            alive = [p for p in self.procs if p.is_alive()]
            if not alive:
                break
            log.warning("%s worker pid(s) %s", sig_step, ", ".join(str(p.pid) for p in alive))
            for p in alive:
                getattr(p, sig_step)()
            self._wait_exit(3.0)
        for ch in self.channels:
            ch.conn.close()
        self.store = None

    def _wait_exit(self, timeout_s: float) -> None:
        """Join the workers, still writing their last log records so none blocks on a full pipe."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            alive = [(ch, p) for ch, p in zip(self.channels, self.procs) if p.is_alive()]
            if not alive:
                break
            objs = [p.sentinel for _, p in alive] + [ch.conn for ch, _ in alive if not ch.conn.closed]
            for obj in wait(objs, timeout=max(0.0, end - time.monotonic())):
                for ch, _ in alive:
                    if obj is ch.conn:
                        try:
                            msg = ch.recv()
                        except (EOFError, OSError):
                            ch.conn.close()
                            continue
                        if msg[0] == "log":
                            _emit_forwarded(msg)
        for p in self.procs:
            p.join(0.0)


def _emit_forwarded(msg: tuple) -> None:
    """Write a worker's log record through the controller's handlers (console and run log)."""
    _, name, level, text = msg
    logger = logging.getLogger(name)
    logger.handle(logging.makeLogRecord({"name": name, "levelno": level, "levelname": logging.getLevelName(level), "msg": text}))
