"""Reward calls with a wall-clock deadline: `reward.timeout_s` per batch, on a few threads.

    outcomes = call_with_deadline(fn, [(item,), ...], workers=8, timeout_s=300, name="my_mod:f")
    # one Outcome per call, in order: .value, .error (the exception it raised) or .late (still running at the deadline)

Each call runs on one of `workers` daemon threads (at most one per call). When the deadline passes, the calls that
have not returned are reported late and the caller scores those samples `reward.error_score`; the step goes on.

What happens to a late call: a Python thread cannot be stopped from outside, so it keeps running until the function
returns on its own, and its result is dropped. Its thread takes no new calls, and the next batch gets fresh threads,
so one stuck call costs one thread, not the run. Calls still running long after their batch are counted; past
`MAX_STUCK_PER_WORKER` per worker thread the run stops with a message that names the function (it hangs for good).

Why threads and not a process pool: a process could be killed, but every reward function would then have to be
importable and picklable in another process, every item copied there and back, and state a function keeps (a client
session, a cache, a loaded model) would exist once per process; most slow calls are slow rather than hung, and a
thread serves them at no cost. What a thread cannot do: interrupt C code that holds the GIL (a catastrophic regular
expression in `re` is the usual one): that stalls the whole process, and only the worker group's phase deadline
(`cluster.collective_timeout_s`) ends the run. Bound such code yourself (the `regex` package's `timeout=`, input
length limits), or run it in a sandbox service behind `reward=remote`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridrl.errors import HybridRLError

MAX_STUCK_PER_WORKER = 4
"""Late calls still running (per worker thread) at which the run stops: the function hangs rather than runs slow."""

_stuck: dict[str, set[threading.Thread]] = {}  # by function name
_stuck_lock = threading.Lock()


@dataclass
class Outcome:
    """What one call came to: a value, an exception, or nothing by the deadline."""

    value: Any = None
    error: BaseException | None = None
    late: bool = False
    done: bool = False


def stuck_calls(name: str) -> int:
    """Late calls of reward function `name` from earlier batches that have still not returned."""
    with _stuck_lock:
        threads = _stuck.setdefault(name, set())
        for t in [t for t in threads if not t.is_alive()]:
            threads.discard(t)
        return len(threads)


def call_with_deadline(
    fn: Callable[..., Any], calls: Sequence[tuple], workers: int, timeout_s: float, name: str
) -> list[Outcome]:
    """`fn(*args)` for each args tuple of `calls` on up to `workers` threads; every call has returned, raised or been
    marked late within `timeout_s` seconds of the start. A HybridRLError raised by a call is re-raised here (it is
    the user's error, not a sample's)."""
    stuck = stuck_calls(name)
    if stuck >= MAX_STUCK_PER_WORKER * workers:
        raise HybridRLError(
            f"reward function {name}: {stuck} calls from earlier batches are still running long past "
            f"reward.timeout_s={timeout_s:g} s; it hangs on some inputs. Fix it or bound its time yourself "
            "(a Python thread cannot be stopped from outside)"
        )
    outcomes = [Outcome() for _ in calls]
    lock = threading.Condition()
    state = {"next": 0, "finished": 0, "closed": False}

    def work() -> None:
        while True:
            with lock:
                if state["closed"] or state["next"] >= len(calls):
                    return
                i = state["next"]
                state["next"] += 1
            try:
                value, error = fn(*calls[i]), None
            except BaseException as e:  # noqa: BLE001 - recorded and judged by the caller
                value, error = None, e
            with lock:
                if not state["closed"]:
                    outcomes[i].value, outcomes[i].error, outcomes[i].done = value, error, True
                    state["finished"] += 1
                    lock.notify_all()

    threads = [
        threading.Thread(target=work, name=f"hybridrl-reward-{k}", daemon=True)
        for k in range(max(1, min(workers, len(calls))))
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    with lock:
        while state["finished"] < len(calls):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            lock.wait(left)
        state["closed"] = True  # late calls' results are dropped; no thread takes another call
    late_threads = [t for t in threads if t.is_alive()]
    for o in outcomes:
        if not o.done:
            o.late = True
    if late_threads:
        with _stuck_lock:
            _stuck.setdefault(name, set()).update(late_threads)
    for o in outcomes:
        if isinstance(o.error, HybridRLError):
            raise o.error
        if o.error is not None and not isinstance(o.error, Exception):  # KeyboardInterrupt, SystemExit in a call
            raise o.error
    return outcomes
