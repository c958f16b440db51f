"""The agent loop in a child process: its Python (parsing turns, running tools, rendering tool turns) off the
interpreter that drives the engine.

    trajectories = generate_agent(loop, engine, prompts, params)    # the worker's generate phase (`agent.process`)
    child = child_process_for(loop, engine)                         # the loop's child, or None to run it here
    trajectories = child.run(engine, "generate", prompts, params, None)

Why: on a GPU the native engine's driver launches a decode step every millisecond or two, while the agents' own work
between turns takes a few hundred microseconds a turn, thousands of turns a rollout. In one process both share one
interpreter lock, so a multi-turn rollout's steps wait for the host rather than the device; in a child process the
agents run on another core. (verl runs its agent loops in worker processes of their own for the same reason.)

The worker's process keeps the engine and serves the child's requests through the engine's request stream
(`AsyncEngine.add`/`advance`, so a TP leader's lockstep and the cache sizing are the in-process stream's): it steps
while anything runs and sends each step's completions back. The child (`hybridrl.agent.child`) runs the job's
coroutine over a stand-in engine whose requests cross the socket; they are keyed as in process, so a trajectory draws
the same tokens either way. A child that dies, or whose event loop stops answering for `HEARTBEAT_DEADLINE_S`, fails
the phase with an error saying so, and a new child starts at the next job.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import select
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch

from hybridrl.agent.child import (
    CLOSE,
    COMPLETIONS,
    FAILED,
    HEADER,
    JOBS,
    REFUSED,
    REQUESTS,
    RESULT,
    RUN,
    child_main,
    frame,
)
from hybridrl.agent.config import AgentConfig
from hybridrl.agent.loop import AgentLoop, Trajectory
from hybridrl.engines.base import SamplingParams
from hybridrl.engines.native.frozen_heap import frozen_heap
from hybridrl.errors import HybridRLError

log = logging.getLogger(__name__)

HEARTBEAT_DEADLINE_S = 60.0
"""Silence from the child (no request, no heartbeat) after which the phase fails while the engine has nothing to do."""
START_DEADLINE_S = 300.0
"""How long the child may take to start (import, tokenizer, tools) and answer its first job's first message."""
FRAME_DEADLINE_S = 60.0
"""How long the rest of a frame may take to arrive once its first bytes have."""
STOP_DEADLINE_S = 10.0
"""How long `close` waits for the child to exit before killing it."""


def generate_agent(
    loop: AgentLoop,
    engine: object,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    messages: Sequence[Sequence[dict[str, Any]]] | None = None,
) -> list[Trajectory]:
    """`loop.generate_sync`, in the loop's child process where `agent.process` puts it there."""
    child = child_process_for(loop, engine)
    if child is None:
        return loop.generate_sync(engine, prompts, params, messages)
    return child.run(engine, "generate", prompts, params, messages)


def child_process_for(loop: AgentLoop, engine: object) -> AgentProcess | None:
    """The child process that runs `loop`'s turns against `engine` (`agent.process`; started at its first job, kept
    on the loop across steps and closed with it), or None to run them in this process."""
    mode = loop.cfg.process
    if mode == "worker":
        return None
    native = all(hasattr(engine, a) for a in ("submit", "step", "async_engine"))
    on_gpu = getattr(getattr(engine, "device", None), "type", None) == "cuda"
    if mode == "auto" and not (native and on_gpu and loop.tools_from_config):
        return None
    if not native:
        raise HybridRLError(
            "agent.process=child needs the native engine (its request stream is served to the child process); "
            f"{type(engine).__name__} serves the agent loop in the worker: set agent.process=worker or auto"
        )
    if not loop.tools_from_config:
        raise HybridRLError(
            "agent.process=child: this loop was given tool instances, which a child process cannot rebuild from "
            "agent.tools; set agent.process=worker"
        )
    if loop.child is None:
        loop.child = AgentProcess(loop.cfg, loop.tokenizer)
    return loop.child


class AgentProcess:
    """The agent loop of one worker in a child process, fed turns by this process's engine."""

    def __init__(self, cfg: AgentConfig, tokenizer) -> None:
        """`cfg`: the agent section (the child builds its tools and parser from it); `tokenizer`: the run's, sent to
        the child (pickled) when it starts."""
        self.cfg, self.tokenizer = cfg, tokenizer
        self._process: multiprocessing.process.BaseProcess | None = None
        self._sock: socket.socket | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs."""
        return self._process.pid if self._process is not None else None

    def run(self, engine, job: str, *args: Any) -> Any:
        """Run `job` ("generate": `AgentLoop.generate`'s arguments after the engine; "partial":
        `hybridrl.agent.partial.run_partial`'s) in the child, serving its turns from `engine` (a native engine:
        `async_engine` with `add`/`advance`) until the job's result comes back and the engine has stopped."""
        stream = engine.async_engine(self.cfg.max_total_tokens)
        if stream is None or not hasattr(stream, "advance"):
            raise HybridRLError(
                f"agent.process: {type(engine).__name__} has no request stream a child process can be served from; "
                "set agent.process=worker"
            )
        if job not in JOBS:
            raise HybridRLError(f"agent process: no job {job!r}; jobs: {sorted(JOBS)}")
        started = self._process is None
        if started:
            self._start()
        try:
            with frozen_heap(), torch.inference_mode():
                return self._serve(stream, job, args, START_DEADLINE_S if started else HEARTBEAT_DEADLINE_S)
        except BaseException:
            self._stop(kill=True)  # its turns are lost with the phase; the next job starts a new child
            raise

    def close(self) -> None:
        """Stop the child (it closes its tools)."""
        self._stop(kill=False)

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        context = multiprocessing.get_context("spawn")  # this process holds CUDA state and threads: never fork it
        process = context.Process(
            target=child_main, args=(theirs, self.cfg, self.tokenizer), name="hybridrl-agent", daemon=True
        )
        try:
            process.start()
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # what spawn could not send
            ours.close()
            raise HybridRLError(
                f"agent.process: the agent config or the tokenizer cannot be sent to a child process ({e}); "
                "set agent.process=worker"
            ) from e
        finally:
            theirs.close()
        self._process, self._sock = process, ours
        log.info(
            "agent loop: its turns run in a child process, pid %d (agent.process=%s)", process.pid, self.cfg.process
        )

    def _stop(self, kill: bool) -> None:
        process, sock = self._process, self._sock
        self._process = self._sock = None
        if process is None:
            return
        if not kill and process.is_alive():
            try:
                sock.sendall(frame((CLOSE,)))
            except OSError:
                pass
            process.join(STOP_DEADLINE_S)
        if process.is_alive():
            process.kill()
            process.join(STOP_DEADLINE_S)
        sock.close()

    def _serve(self, stream, job: str, args: tuple, first_deadline_s: float) -> Any:
        self._send((RUN, job, args))
        ids: dict[int, int] = {}  # engine handle → the child's request id
        result: Any = _NOTHING
        heard, deadline_s = time.monotonic(), first_deadline_s
        while True:
            messages = self._receive(0.0 if stream.busy else 0.05)
            if messages:
                heard, deadline_s = time.monotonic(), HEARTBEAT_DEADLINE_S
            refused = []
            for message in messages:
                kind = message[0]
                if kind == REQUESTS:
                    for rid, request, params in message[1]:
                        try:
                            ids[stream.add(request, params)] = rid
                        except Exception as e:  # a bad request (an empty prompt, too long): only its trajectory fails
                            refused.append((rid, f"{type(e).__name__}: {e}"))
                elif kind == RESULT:
                    result = message[1]
                elif kind == FAILED:
                    raise HybridRLError(f"agent process: the {job} job failed in the child process:\n{message[1]}")
            if refused:
                self._send((REFUSED, refused))
            if stream.busy:
                done = stream.advance()
                if done:
                    self._send((COMPLETIONS, [(ids.pop(handle), c) for handle, c in done]))
            elif result is not _NOTHING:
                return result
            elif not messages:
                self._check_alive(time.monotonic() - heard, deadline_s)

    def _check_alive(self, silent_s: float, deadline_s: float) -> None:
        if not self._process.is_alive():
            raise self._gone(None)
        if silent_s > deadline_s:
            raise HybridRLError(
                f"agent process: no word from the agent loop's process in {deadline_s:g} s while the engine had "
                "nothing to run: its event loop is blocked (a tool computing or waiting in `acall` instead of "
                "awaiting; make it synchronous, `call`, to run in the tool thread pool)"
            )

    def _send(self, message: object) -> None:
        try:
            self._sock.sendall(frame(message))
        except OSError as e:
            raise self._gone(e) from e

    def _receive(self, timeout: float) -> list:
        """Every whole message waiting now (waiting up to `timeout` for the first)."""
        out = []
        while select.select([self._sock], [], [], timeout if not out else 0.0)[0]:
            header = self._read(HEADER.size)
            out.append(pickle.loads(self._read(HEADER.unpack(header)[0])))
        return out

    def _read(self, n: int) -> bytearray:
        buf, got = bytearray(n), 0
        view = memoryview(buf)
        self._sock.settimeout(FRAME_DEADLINE_S)
        try:
            while got < n:
                k = self._sock.recv_into(view[got:])
                if k == 0:
                    raise self._gone(None)
                got += k
        except TimeoutError as e:
            raise HybridRLError(f"agent process: a message stopped arriving for {FRAME_DEADLINE_S:g} s") from e
        except OSError as e:  # the child died with bytes unread (a reset rather than an end of input)
            raise self._gone(e) from e
        finally:
            self._sock.settimeout(None)
        return buf

    def _gone(self, error: OSError | None) -> HybridRLError:
        """The error for a child whose end of the socket closed before its job ended."""
        self._process.join(STOP_DEADLINE_S)  # its exit code, where it is exiting
        code = self._process.exitcode
        how = f"exited with code {code}" if code is not None else f"closed its end ({error or 'end of input'})"
        return HybridRLError(
            f"agent process: the agent loop's process {how} before its job ended; its own error, if it printed one, "
            "is above"
        )


_NOTHING = object()
