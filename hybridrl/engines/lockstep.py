"""One engine schedule for a TP group: the leader's, replayed by the other ranks (agent rollouts at engine.tp_size > 1).

Every rank of an engine TP group must build the same batches: a step's forward runs collectives across the group.
Requests that join a running batch one by one (agent turns, continuous batching) arrive when each rank's trajectory
gets back from its tool, which is a different moment on every rank. So with engine.tp_size > 1 only the TP leader runs
the agent loop (its tools run once per group, not once per rank); before each engine step it broadcasts the requests
it added since the last one, and the other ranks add the same requests and take the same step::

    leader                                            every other rank of the group
    with engine.lead(group):                          engine.follow(group)      # until the leader's phase ends
        agent_loop.generate_sync(engine, ...)           loop: receive → add those requests → step
            (each engine step: send what was added)

A message is an int64 header [kind, payload bytes] and, for a payload, its pickled bytes, broadcast over the group's
gloo (host) group: one small broadcast per step, off the device's stream, so the device keeps running ahead.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.errors import HybridRLError

SIZE, STEP, DONE, FAIL = 0, 1, 2, 3
"""Message kinds: size the engine for sequences of a given length; add requests, then step; the leader's phase
ended; the leader failed (payload: its error)."""


class Lockstep:
    """The leader's side (`send`) and the followers' (`receive`) of one TP group's schedule."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        """`group`: the engine TP group, on a host backend (gloo); its rank 0 leads."""
        self.group = group
        self.leader = dist.get_rank(group) == 0
        self.steps = 0  # steps sent or received

    def send(self, kind: int, payload: Any = None) -> None:
        """Leader: broadcast one message to the group."""
        data = b"" if payload is None else pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        dist.broadcast(torch.tensor([kind, len(data)], dtype=torch.int64), group=self.group, group_src=0)
        if data:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            dist.broadcast(buf, group=self.group, group_src=0)
        self.steps += kind == STEP

    def receive(self) -> tuple[int, Any]:
        """Follower: the leader's next message (kind, payload); a FAIL message raises its error here."""
        header = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(header, group=self.group, group_src=0)
        kind, size = (int(v) for v in header)
        payload = None
        if size:
            buf = torch.empty(size, dtype=torch.uint8)
            dist.broadcast(buf, group=self.group, group_src=0)
            payload = pickle.loads(buf.numpy().tobytes())
        if kind == FAIL:
            raise HybridRLError(f"the engine TP group's leader failed in its generate phase: {payload}")
        self.steps += kind == STEP
        return kind, payload


@contextmanager
def leading(group: dist.ProcessGroup) -> Iterator[Lockstep]:
    """The leader's side for the enclosed generate phase: leaving the block ends the followers' phase (DONE), or fails
    it with the block's error (FAIL), so no rank waits for a leader that is gone."""
    lockstep = Lockstep(group)
    try:
        yield lockstep
    except BaseException as e:
        lockstep.send(FAIL, f"{type(e).__name__}: {e}")
        raise
    lockstep.send(DONE)
