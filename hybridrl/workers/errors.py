"""Errors of a worker group: a worker that raised, died or stopped answering during a phase."""

from __future__ import annotations

import signal

from hybridrl.errors import HybridRLError


class WorkerFailure(HybridRLError):
    """A worker failed during a phase command; the message names the rank and the phase.

    The app prints it as one line; the worker's traceback (when it raised) is in the log once.
    """

    def __init__(self, message: str, rank: int | None = None, phase: str | None = None) -> None:
        super().__init__(message)
        self.rank, self.phase = rank, phase


def died_message(rank: int, phase: str, exitcode: int | None) -> str:
    """`worker rank 1 died during 'update' (exit code -9: SIGKILL)`."""
    how = "exit code unknown" if exitcode is None else f"exit code {exitcode}"
    if exitcode is not None and exitcode < 0:
        try:
            how += f": {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"worker rank {rank} died during {phase!r} ({how})"


def raised_message(rank: int, phase: str, summary: str) -> str:
    """`worker rank 0 raised in 'generate': ValueError: ...`."""
    return f"worker rank {rank} raised in {phase!r}: {summary}"


def timeout_message(ranks: list[int], phase: str, waited_s: float, timeout_s: float) -> str:
    """`worker rank 1 timed out during 'reward' (no answer after 25s; cluster.collective_timeout_s=20)`."""
    who = f"worker rank {ranks[0]}" if len(ranks) == 1 else "worker ranks " + ", ".join(map(str, ranks))
    return (
        f"{who} timed out during {phase!r} (no answer after {waited_s:.0f}s; "
        f"cluster.collective_timeout_s={timeout_s:g})"
    )
