"""`cluster=inline`: the one worker lives inside the controller's process (the default on CPU or one GPU).

Its phases get the same deadline as `cluster=local`'s (`phase_deadline_s(cluster.collective_timeout_s)`, start-up
`STARTUP_S` more): a phase still running then ends with the same one-line error, naming rank 0 and the phase. The
worker runs in the controller's own thread, so the deadline has to interrupt it from inside::

    run(phase):  timer armed → the phase runs → timer cancelled
    timer fires: SIGUSR1 to the main thread → its handler raises PhaseTimeout there (a BaseException, so no
                 `except Exception` in the phase's code swallows it; a blocking call is interrupted too)
                 → WorkerFailure naming the phase
    still stuck `BACKSTOP_S` later (C code holding the GIL runs no signal handler): faulthandler prints every
                 thread's stack to stderr and exits the process with code 1

Off the main thread (an embedding application's thread) signals cannot be used, and the phases run without a deadline.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from hybridrl.phases import Phase
from hybridrl.workers.errors import WorkerFailure, timeout_message
from hybridrl.workers.failures import STARTUP_S, phase_deadline_s
from hybridrl.workers.group import WorkerGroup
from hybridrl.workers.worker import HybridWorker

log = logging.getLogger("hybridrl")

BACKSTOP_S = 60.0
"""After a missed deadline, how long the signal may take to be handled before the process is ended from C."""
SHUTDOWN_S = 60.0
"""The deadline of the worker's own shutdown after a failure."""


class PhaseTimeout(BaseException):
    """Raised in the main thread when the running phase passed its deadline."""


class PhaseDeadline:
    """Interrupts the main thread when a phase runs past its deadline (see the module docstring)."""

    def __init__(self) -> None:
        self.enabled = threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_kill")
        self.active: object | None = None  # the token of the phase being timed
        self.previous: Any = None
        if self.enabled:
            self.previous = signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.active is not None:
            self.active = None
            raise PhaseTimeout()

    def call(self, fn: Any, deadline_s: float, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in this thread, interrupted by PhaseTimeout after `deadline_s`."""
        if not self.enabled:
            return fn(*args, **kwargs)
        token = object()
        main = threading.main_thread().ident

        def fire() -> None:
            if self.active is token:
                signal.pthread_kill(main, signal.SIGUSR1)

        timer = threading.Timer(deadline_s, fire)
        timer.daemon = True
        self.active = token
        timer.start()
        backstop = _arm_backstop(deadline_s + BACKSTOP_S)
        try:
            return fn(*args, **kwargs)
        finally:
            self.active = None
            timer.cancel()
            if backstop:
                faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        """Put back the SIGUSR1 handler that was there before."""
        if self.enabled:
            signal.signal(signal.SIGUSR1, self.previous if self.previous is not None else signal.SIG_DFL)
            self.enabled = False


def _arm_backstop(after_s: float) -> bool:
    """faulthandler's C-level timer: every thread's stack to the real stderr, then exit(1); False where it cannot."""
    try:
        faulthandler.dump_traceback_later(after_s, exit=True, file=sys.__stderr__)
        return True
    except (AttributeError, ValueError, RuntimeError, OSError):  # no usable stderr (an embedding application)
        return False


class InlineWorkerGroup(WorkerGroup):
    """One worker inside the controller process (the default on CPU or one GPU, and in tests)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg.topology())
        self.timeout_s = cfg.cluster.collective_timeout_s
        self.deadline_s = phase_deadline_s(self.timeout_s)
        self.deadline = PhaseDeadline()
        self.worker: Any = None
        try:
            self.worker = self._timed(
                "init", self.deadline_s + STARTUP_S, lambda: HybridWorker(cfg, rank=0, world_size=1, local_rank=0)
            )
        except BaseException:
            self.deadline.close()
            raise

    def _timed(self, phase: str, deadline_s: float, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        try:
            return self.deadline.call(fn, deadline_s, *args, **kwargs)
        except PhaseTimeout:
            message = timeout_message([0], phase, time.monotonic() - t0, self.timeout_s)
            raise WorkerFailure(message, rank=0, phase=phase) from None

    def run(self, phase: Phase, per_rank_args: Sequence[tuple] | None = None, **kwargs: Any) -> list[Any]:
        if self.worker is None:
            raise WorkerFailure(f"cannot run {str(phase)!r}: the worker group has shut down", phase=str(phase))
        args = per_rank_args[0] if per_rank_args else ()
        name = Phase(phase).value
        return [self._timed(name, self.deadline_s, getattr(self.worker, name), *args, **kwargs)]

    def shutdown(self) -> None:
        worker, self.worker = self.worker, None
        try:
            if worker is not None:
                self._timed("shutdown", SHUTDOWN_S, worker.shutdown)
        except WorkerFailure as e:  # the run is ending anyway: say so, and go on
            log.warning("%s; leaving it", e)
        finally:
            self.deadline.close()
