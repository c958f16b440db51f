"""The commands a controller sends to workers: the loop's phases and the few housekeeping calls.

The controller and the worker groups name commands by this enum, never by free strings; a worker implements each
as the method of the same name (`HybridWorker.wake`, ...). One iteration::

    WAKE → GENERATE → SLEEP → LOGPROB → [VALUES] → REWARD → (advantages on the controller)
         → [UPDATE_CRITIC] → UPDATE → RESHARD
"""

from __future__ import annotations

from enum import Enum


class Phase(str, Enum):
    """A worker command; its value is the `HybridWorker` method that runs it."""

    WAKE = "wake"
    GENERATE = "generate"
    GENERATE_PARTIAL = "generate_partial"
    SLEEP = "sleep"
    LOGPROB = "logprob"
    VALUES = "values"
    REWARD = "reward"
    UPDATE_CRITIC = "update_critic"
    UPDATE = "update"
    RESHARD = "reshard"
    SAVE_CHECKPOINT = "save_checkpoint"
    LOAD_CHECKPOINT = "load_checkpoint"
    MEMORY_REPORT = "memory_report"

    def __str__(self) -> str:  # error messages say 'update', not 'Phase.UPDATE'
        return self.value


#: The loop's timed phases, in order; `advantages` runs on the controller. Each gets a `time/<phase>` metric.
TIMED_PHASES: tuple[str, ...] = (
    "wake",
    "generate",
    "sleep",
    "logprob",
    "values",
    "reward",
    "advantages",
    "update_critic",
    "update",
    "reshard",
)
