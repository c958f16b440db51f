"""Where a rollout's wall time goes on the host: the native engine's steps split into waits for the device and host
work, and the event loop's callbacks (the agents' turns), for `benchmarks.engine --case multiturn --host-timing`.

    timing = HostTiming()
    with timing.installed():                   # wraps the functions below for the block
        timing.reset(); seconds = run(); figures = timing.figures(seconds)   # multiturn_workload.timed_host

On a GPU the engine's driver thread steps the engine (`Scheduler.step`); each step reads the outputs of the step it
launched before (`HostCopy.result`, which waits on the device). Host work in a step is its time less that wait: the
scheduler's Python, the launches, and any wait for the interpreter lock while the event loop's thread runs the
agents' callbacks (`loop_s`). A step's device wait near zero means the device waited for the host instead. With
the agent loop in its child process (`agent.process=child`, a GPU's default) the worker's thread serves the child
between steps (`between_steps_ms`) and no event loop runs here: `loop_s` reads 0.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager

from hybridrl.engines.native import step_io
from hybridrl.engines.native.scheduler import Scheduler

_KEYS = ("step_s", "device_wait_s", "admit_s", "steps", "loop_s", "loop_callbacks")


class HostTiming:
    """Accumulated host times of one run (the driver thread writes the step keys, the loop's thread the loop keys)."""

    def __init__(self) -> None:
        self.acc = dict.fromkeys(_KEYS, 0.0)
        self.runs: list[dict] = []  # `figures` of each run timed so far (benchmarks.multiturn_workload.timed_host)

    def reset(self) -> None:
        self.acc = dict.fromkeys(_KEYS, 0.0)

    def figures(self, wall_s: float) -> dict:
        """This run's totals and, per engine step, its host work, device wait and time between steps (ms)."""
        a, steps = self.acc, max(1.0, self.acc["steps"])
        return {
            **{k: round(v, 4) for k, v in a.items()},
            "wall_s": round(wall_s, 4),
            "host_ms_per_step": round((a["step_s"] - a["device_wait_s"]) / steps * 1e3, 3),
            "device_wait_ms_per_step": round(a["device_wait_s"] / steps * 1e3, 3),
            "admit_ms_per_step": round(a["admit_s"] / steps * 1e3, 3),
            "between_steps_ms": round((wall_s - a["step_s"]) / steps * 1e3, 3),
            "loop_share_of_wall": round(a["loop_s"] / wall_s, 3) if wall_s else None,
        }

    @contextmanager
    def installed(self):
        """Time `Scheduler.step`, `Scheduler._admit`, the device wait in `HostCopy.result` and every event-loop
        callback (`asyncio.events.Handle._run`) while the block runs."""
        timing = self
        real_step, real_admit = Scheduler.step, Scheduler._admit
        real_result, real_run = step_io.HostCopy.result, asyncio.events.Handle._run

        def clocked(fn, seconds: str, count: str | None = None):
            def wrapper(obj):
                t0 = time.perf_counter()
                try:
                    return fn(obj)
                finally:
                    timing.acc[seconds] += time.perf_counter() - t0
                    if count is not None:
                        timing.acc[count] += 1

            return wrapper

        def result(copy):
            if copy.event is not None:
                t0 = time.perf_counter()
                copy.event.synchronize()
                timing.acc["device_wait_s"] += time.perf_counter() - t0
            return real_result(copy)

        step, admit = clocked(real_step, "step_s", "steps"), clocked(real_admit, "admit_s")
        run = clocked(real_run, "loop_s", "loop_callbacks")
        Scheduler.step, Scheduler._admit = step, admit
        step_io.HostCopy.result, asyncio.events.Handle._run = result, run
        try:
            yield self
        finally:
            Scheduler.step, Scheduler._admit = real_step, real_admit
            step_io.HostCopy.result, asyncio.events.Handle._run = real_result, real_run
