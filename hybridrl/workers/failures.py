"""The one failure path every worker group shares: collect each rank's answer to a command, and turn deaths,
errors and silences into one `WorkerFailure` that names the rank that caused them and the phase.

A backend (local processes, Ray actors) waits in its own way and reports what it sees::

    answers = Answers(phase, world_size, deadline_s, timeout_s)
    while answers.waiting():
        for each event within answers.remaining():   # a result, an error, a death
            answers.ok(rank, value) | answers.failed(Failure(...))
    return answers.results(on_failure=group.shutdown)  # in rank order, or raises WorkerFailure

Who is blamed: a death outranks the errors it causes in its peers; an error outranks a silence; but when the errors
are peers timing out inside a collective while a rank says nothing, the silent rank is the stuck one.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridrl.workers.errors import WorkerFailure, timeout_message

log = logging.getLogger("hybridrl")

FAILURE_GRACE_S = 2.0  # after a first failure, how long to listen for the others (to name the cause)
STARTUP_S = 300.0  # start-up (imports, model loading) may take this much longer than a phase

# What a rank's error says when it timed out waiting for a peer inside a collective (gloo, NCCL, the store);
# compared in lower case.
_COLLECTIVE_TIMEOUT_MARKS = ("timed out", "timeout", "distbackenderror", "distnetworkerror", "watchdog")


def phase_deadline_s(collective_timeout_s: float) -> float:
    """How long the controller waits for a phase: the workers' own collective timeout fires first."""
    return collective_timeout_s + min(60.0, max(5.0, 0.1 * collective_timeout_s))


def error_summary(exc: BaseException) -> str:
    """`ValueError: message` (the last line of the exception, as Python prints it)."""
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


@dataclass
class Failure:
    """What went wrong on one rank."""

    kind: str
    """died | raised | timeout"""
    rank: int
    message: str
    """One line, naming the rank and the phase."""
    traceback: str | None = None
    """The worker's traceback, when it raised."""

    @property
    def waited_on_peer(self) -> bool:
        """An error that is a timeout inside a collective: a symptom of another rank, not a cause."""
        text = self.message.lower()
        return self.kind == "raised" and any(m in text for m in _COLLECTIVE_TIMEOUT_MARKS)


class Answers:
    """Every rank's answer to one command, with the deadline and the grace after a first failure."""

    def __init__(self, phase: str, world_size: int, deadline_s: float, timeout_s: float) -> None:
        self.phase, self.timeout_s = str(phase), timeout_s
        self.pending = set(range(world_size))
        self.values: dict[int, Any] = {}
        self.failures: list[Failure] = []
        self.start = time.monotonic()
        self.deadline = self.start + deadline_s
        self.first_failure: float | None = None

    def ok(self, rank: int, value: Any) -> None:
        """Rank `rank` answered."""
        self.values[rank] = value
        self.pending.discard(rank)

    def failed(self, failure: Failure) -> None:
        """Rank `failure.rank` died or raised."""
        self.failures.append(failure)
        self.pending.discard(failure.rank)
        if self.first_failure is None:
            self.first_failure = time.monotonic()

    def limit(self) -> float:
        """When to stop waiting: the deadline, or a short grace after the first failure."""
        return self.deadline if self.first_failure is None else min(self.deadline, self.first_failure + FAILURE_GRACE_S)

    def remaining(self) -> float:
        """Seconds left to wait (>= 0)."""
        return max(0.0, self.limit() - time.monotonic())

    def waiting(self) -> bool:
        """Whether some rank has not answered and there is time left."""
        return bool(self.pending) and time.monotonic() < self.limit()

    def results(self, on_failure: Callable[[], None]) -> list[Any]:
        """The answers in rank order; otherwise log the cause, call `on_failure` (stop every worker) and raise."""
        failures = list(self.failures)
        if self.pending:
            ranks = sorted(self.pending)
            waited = time.monotonic() - self.start
            if failures and all(f.waited_on_peer for f in failures):
                message = (
                    f"worker rank {ranks[0]} stopped answering during {self.phase!r}: its peers timed out "
                    f"waiting for it in a collective (cluster.collective_timeout_s={self.timeout_s:g})"
                )
                failures = [Failure("timeout", ranks[0], message)]
            else:
                failures.append(
                    Failure("timeout", ranks[0], timeout_message(ranks, self.phase, waited, self.timeout_s))
                )
        if not failures:
            return [self.values[r] for r in sorted(self.values)]
        raise_failure(self.phase, failures, on_failure)


def raise_failure(phase: str, failures: list[Failure], on_failure: Callable[[], None]) -> None:
    """Log the cause (and its traceback) once and the others as one line each, call `on_failure`, raise."""
    order = {"died": 0, "raised": 1, "timeout": 2}
    cause = min(failures, key=lambda f: (order[f.kind], f.waited_on_peer, f.rank))
    if cause.traceback:
        log.error("worker rank %d traceback:\n%s", cause.rank, cause.traceback.rstrip())
    for f in failures:
        if f is not cause:
            log.warning("also: %s", f.message)
    on_failure()
    raise WorkerFailure(cause.message, rank=cause.rank, phase=str(phase))
