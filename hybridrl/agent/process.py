"""The agent loop in a child process: its Python (parsing turns, running tools, rendering tool turns) off the
interpreter that drives the engine.

    process = AgentProcess(cfg.agent, tokenizer)        # one per worker; the child starts at its first job
    trajectories = process.run(engine, "generate", prompts, params, messages)     # the worker's generate phase
    process.close()

Why: on a GPU the native engine's driver launches a decode step every millisecond or two, while the agents' own work
between turns takes a few hundred microseconds a turn, thousands of turns a rollout. In one process both share one
interpreter lock, so a multi-turn rollout's steps wait for the host rather than the device; in a child process the
agents run on another core. (verl runs its agent loops in worker processes of their own for the same reason.)

The worker's process keeps the engine and serves the child's requests through the engine's request stream
(`AsyncEngine.add`/`advance`, so a TP leader's lockstep and the cache sizing are the in-process stream's): it steps
while anything runs and sends each step's completions back. The child runs the job's coroutine (`AgentLoop.generate`,
or the partial rollout's `run_partial`) over `PipeEngine`, an `AsyncGenerator` whose requests cross the socket. The
requests are keyed as in process, so a trajectory draws the same tokens either way.

Messages are pickled frames (an 8-byte length, then the payload) between the two processes of one worker; nothing
read from a file or a user's data is unpickled. The child's writes go through its event loop's buffered transport and
never block it, so neither side can wait on the other's full buffer. The child answers a job with its result or its
error's traceback and sends a heartbeat while it runs: a child that dies, or whose event loop stops answering for
`HEARTBEAT_DEADLINE_S`, fails the phase with an error saying so, and a new child starts at the next job.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import select
import socket
import struct
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import torch

from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams
from hybridrl.engines.native.frozen_heap import frozen_heap
from hybridrl.errors import HybridRLError

if TYPE_CHECKING:
    from hybridrl.agent.config import AgentConfig
    from hybridrl.agent.loop import AgentLoop

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
"""How often the child says it is alive while a job runs."""
HEARTBEAT_DEADLINE_S = 60.0
"""Silence from the child (no request, no heartbeat) after which the phase fails while the engine has nothing to do."""
START_DEADLINE_S = 300.0
"""How long the child may take to start (import, tokenizer, tools) and answer its first job's first message."""
FRAME_DEADLINE_S = 60.0
"""How long the rest of a frame may take to arrive once its first bytes have."""
STOP_DEADLINE_S = 10.0
"""How long `close` waits for the child to exit before killing it."""

# Message kinds. Worker → child: RUN (job, args), COMPLETIONS [(id, Completion)], REFUSED [(id, reason)], CLOSE.
# Child → worker: REQUESTS [(id, request, params)], BEAT, RESULT (value), FAILED (traceback text).
RUN, COMPLETIONS, REFUSED, CLOSE = "run", "completions", "refused", "close"
REQUESTS, BEAT, RESULT, FAILED = "requests", "beat", "result", "failed"
_HEADER = struct.Struct("!Q")


def _frame(message: object) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


# -- the worker's side ------------------------------------------------------------------------------------------
class AgentProcess:
    """The agent loop of one worker in a child process, fed turns by this process's engine."""

    def __init__(self, cfg: AgentConfig, tokenizer) -> None:
        """`cfg`: the agent section (the child builds its tools and parser from it); `tokenizer`: the run's, sent to
        the child (pickled) when it starts."""
        self.cfg, self.tokenizer = cfg, tokenizer
        self._process: multiprocessing.process.BaseProcess | None = None
        self._sock: socket.socket | None = None

    def run(self, engine, job: str, *args: Any) -> Any:
        """Run `job` ("generate": `AgentLoop.generate`'s arguments after the engine; "partial":
        `hybridrl.rollout.agent.run_partial`'s) in the child, serving its turns from `engine` (a native engine:
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
                sock.sendall(_frame((CLOSE,)))
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
            self._sock.sendall(_frame(message))
        except OSError as e:
            raise self._gone(e) from e

    def _receive(self, timeout: float) -> list:
        """Every whole message waiting now (waiting up to `timeout` for the first)."""
        out = []
        while select.select([self._sock], [], [], timeout if not out else 0.0)[0]:
            header = self._read(_HEADER.size)
            out.append(pickle.loads(self._read(_HEADER.unpack(header)[0])))
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


# -- the child's side -------------------------------------------------------------------------------------------
class _Link:
    """The child's end of the socket: frames written through the event loop's transport (buffered, never blocking
    the loop) and read as they come."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def send(self, message: object) -> None:
        self.writer.write(_frame(message))

    async def receive(self) -> Any:
        """The next message; None at end of input (the worker's process is gone)."""
        try:
            header = await self.reader.readexactly(_HEADER.size)
            return pickle.loads(await self.reader.readexactly(_HEADER.unpack(header)[0]))
        except asyncio.IncompleteReadError:
            return None


class PipeEngine:
    """The child's `AsyncGenerator`: each request goes to the worker's engine (those of one event-loop iteration in
    one message) and its completion comes back by its id."""

    def __init__(self, link: _Link) -> None:
        self._link = link
        self._futures: dict[int, asyncio.Future] = {}
        self._outbox: list[tuple[int, GenerationRequest, SamplingParams]] = []
        self._next_id = 0

    async def generate(self, request: GenerationRequest, params: SamplingParams) -> Completion:
        """The completion of one request, from the worker's engine (params.n is ignored)."""
        loop = asyncio.get_running_loop()
        rid, self._next_id = self._next_id, self._next_id + 1
        future = self._futures[rid] = loop.create_future()
        if not self._outbox:
            loop.call_soon(self._flush)
        self._outbox.append((rid, request, params))
        return await future

    def _flush(self) -> None:
        self._link.send((REQUESTS, self._outbox))
        self._outbox = []

    def settle(self, completions: list[tuple[int, Completion]]) -> None:
        for rid, completion in completions:
            future = self._futures.pop(rid)
            if not future.done():
                future.set_result(completion)

    def refuse(self, refused: list[tuple[int, str]]) -> None:
        for rid, reason in refused:
            future = self._futures.pop(rid)
            if not future.done():
                future.set_exception(HybridRLError(f"native engine refused the request: {reason}"))


def _run_generate(agent: AgentLoop, engine: PipeEngine, *args: Any) -> Awaitable[Any]:
    return agent.generate(engine, *args)


def _run_partial(agent: AgentLoop, engine: PipeEngine, *args: Any) -> Awaitable[Any]:
    from hybridrl.rollout.agent import run_partial  # (it imports the loop, which imports this module)

    return run_partial(agent, engine, *args)


JOBS: dict[str, Callable[..., Awaitable[Any]]] = {"generate": _run_generate, "partial": _run_partial}
"""What a RUN message may ask for: a fixed table, never code sent by the worker."""


def child_main(sock: socket.socket, cfg: AgentConfig, tokenizer) -> None:
    """The child process: build the agent loop (its tools, parser, renderer) and run jobs until told to close or the
    worker's process goes away."""
    torch.set_num_threads(1)  # the agents compute nothing with torch; the engine's process owns the cores' BLAS work
    asyncio.run(_serve_jobs(sock, cfg, tokenizer))


async def _serve_jobs(sock: socket.socket, cfg: AgentConfig, tokenizer) -> None:
    from hybridrl.agent.loop import AgentLoop

    reader, writer = await asyncio.open_connection(sock=sock)
    link = _Link(reader, writer)
    try:
        agent = AgentLoop(cfg, tokenizer)
    except Exception:
        link.send((FAILED, traceback.format_exc()))
        await writer.drain()
        return
    jobs: asyncio.Queue = asyncio.Queue()
    engine: PipeEngine | None = None

    async def read() -> None:
        while True:
            message = await link.receive()
            if message is None or message[0] == CLOSE:
                await jobs.put(None)
                return
            if message[0] == RUN:
                await jobs.put(message[1:])
            elif message[0] == COMPLETIONS:
                engine.settle(message[1])
            elif message[0] == REFUSED:
                engine.refuse(message[1])

    reading = asyncio.create_task(read())
    try:
        while (job := await jobs.get()) is not None:
            name, args = job
            engine = PipeEngine(link)
            beat = asyncio.create_task(_heartbeat(link))
            try:
                with frozen_heap():
                    link.send((RESULT, await JOBS[name](agent, engine, *args)))
            except Exception:
                link.send((FAILED, traceback.format_exc()))
            finally:
                beat.cancel()
            await writer.drain()
    finally:
        reading.cancel()
        agent.close()
        writer.close()


async def _heartbeat(link: _Link) -> None:
    while True:
        await asyncio.sleep(HEARTBEAT_S)
        link.send((BEAT,))
