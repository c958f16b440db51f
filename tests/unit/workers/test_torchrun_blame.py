"""Rank 0's reading of a failed command under torchrun: a rank whose link broke before the launcher's SIGTERM is the
cause, even when the signal is handled before that rank's event is read; a link that broke after the signal belongs
to a rank stopped with the others."""

from __future__ import annotations

import logging
import queue
import time
from types import SimpleNamespace

import pytest

from hybridrl.workers.errors import WorkerFailure
from hybridrl.workers.torchrun import TorchrunWorkerGroup

RESET = "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:16279: Connection reset by peer"


def group_after(broken_s: float) -> TorchrunWorkerGroup:
    """Rank 0 in 'update' (command 7): the launcher's SIGTERM came just now, rank 1's link broke `broken_s` seconds
    from then (before it when negative), and rank 0's own worker raised a gloo read error; both events already wait
    on the queue, rank 0's first."""
    terminated_at = time.monotonic()
    group = object.__new__(TorchrunWorkerGroup)  # the collection logic only; no process group
    group.topology, group.timeout_s = SimpleNamespace(world_size=2), 30.0
    group.events = queue.Queue()
    group.channels = [SimpleNamespace(broken_at=None), SimpleNamespace(broken_at=terminated_at + broken_s)]
    group.info = [(100, "vm"), (101, "vm")]
    group.closed, group.waiting, group.terminated_at = False, False, terminated_at
    group.stopped = 0
    group._stop = lambda: setattr(group, "stopped", group.stopped + 1)
    group.events.put((7, 0, "raised", RESET, "Traceback (most recent call last): ..."))
    group.events.put((7, 1, "died", "RuntimeError: Connection closed by peer", None))
    return group


def test_a_link_broken_before_the_sigterm_names_the_rank_that_died():
    group = group_after(broken_s=-0.05)
    with pytest.raises(WorkerFailure) as failure:
        group._collect("update", 7, deadline_s=5.0)
    assert str(failure.value) == "worker rank 1 died during 'update' (pid 101 on vm: its connection closed)"
    assert failure.value.rank == 1 and group.stopped == 1


def test_a_link_broken_after_the_sigterm_is_a_rank_stopped_with_the_others(caplog):
    group = group_after(broken_s=0.05)
    with caplog.at_level(logging.WARNING, logger="hybridrl"), pytest.raises(WorkerFailure) as failure:
        group._collect("update", 7, deadline_s=5.0)
    assert failure.value.rank == 0 and "Connection reset by peer" in str(failure.value)
    assert "also: worker rank 1 stopped during 'update' (the launcher's SIGTERM)" in caplog.text
