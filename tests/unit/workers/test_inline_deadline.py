"""`cluster=inline` gets the phase deadline `cluster=local` has: a phase that runs past it is interrupted in the
controller's own thread, even inside a blocking call or under an `except Exception`."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from hybridrl.workers.inline import PhaseDeadline, PhaseTimeout


def swallowing_sleep(seconds: float) -> str:
    """A phase whose code catches every Exception (a reward function, a retry loop)."""
    try:
        time.sleep(seconds)  # blocking in C: the signal interrupts it
    except Exception:  # noqa: BLE001 - what careless code does
        return "swallowed"
    return "slept"


def test_a_phase_past_its_deadline_is_interrupted_even_in_a_blocking_call():
    before = signal.getsignal(signal.SIGUSR1)
    deadline = PhaseDeadline()
    try:
        t0 = time.monotonic()
        with pytest.raises(PhaseTimeout):
            deadline.call(swallowing_sleep, 0.3, 30)
        assert time.monotonic() - t0 < 2.0
        assert deadline.call(swallowing_sleep, 5.0, 0.01) == "slept"  # within its deadline: its own result
        time.sleep(0.1)  # a timer of a finished phase never fires into the next code
    finally:
        deadline.close()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_off_the_main_thread_phases_run_without_a_deadline():
    out = {}

    def body():
        d = PhaseDeadline()
        out["enabled"] = d.enabled
        out["result"] = d.call(swallowing_sleep, 0.05, 0.2)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert out == {"enabled": False, "result": "slept"}
