"""The agent loop's child process (`hybridrl.agent.process` starts it and serves it): the loop's jobs over
`PipeEngine`, an `AsyncGenerator` whose requests go to the worker's engine over a socket, and the messages both sides
exchange.

Messages are pickled frames (an 8-byte length, then the payload) between the two processes of one worker; nothing
read from a file or a user's data is unpickled. The child's writes go through its event loop's buffered transport and
never block it, so neither side can wait on the other's full buffer. It answers a job with its result or its error's
traceback, and sends a heartbeat while one runs.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from hybridrl.agent.config import AgentConfig
from hybridrl.agent.loop import AgentLoop
from hybridrl.agent.partial import run_partial
from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams
from hybridrl.engines.native.frozen_heap import frozen_heap
from hybridrl.errors import HybridRLError

HEARTBEAT_S = 1.0
"""How often the child says it is alive while a job runs."""

# Message kinds. Worker → child: RUN (job, args), COMPLETIONS [(id, Completion)], REFUSED [(id, reason)], CLOSE.
# Child → worker: REQUESTS [(id, request, params)], BEAT, RESULT (value), FAILED (traceback text).
RUN, COMPLETIONS, REFUSED, CLOSE = "run", "completions", "refused", "close"
REQUESTS, BEAT, RESULT, FAILED = "requests", "beat", "result", "failed"
HEADER = struct.Struct("!Q")


def frame(message: object) -> bytes:
    """One message as it crosses the socket."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


class _Link:
    """The child's end of the socket: frames written through the event loop's transport (buffered, never blocking
    the loop) and read as they come."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def send(self, message: object) -> None:
        self.writer.write(frame(message))

    async def receive(self) -> Any:
        """The next message; None at end of input (the worker's process is gone)."""
        try:
            header = await self.reader.readexactly(HEADER.size)
            return pickle.loads(await self.reader.readexactly(HEADER.unpack(header)[0]))
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


JOBS: dict[str, Callable[..., Awaitable[Any]]] = {"generate": AgentLoop.generate, "partial": run_partial}
"""What a RUN message may ask for: a fixed table, never code sent by the worker."""


def child_main(sock: socket.socket, cfg: AgentConfig, tokenizer) -> None:
    """The child process: build the agent loop (its tools, parser, renderer) and run jobs until told to close or the
    worker's process goes away."""
    torch.set_num_threads(1)  # the agents compute nothing with torch; the engine's process owns the cores' BLAS work
    asyncio.run(_serve_jobs(sock, cfg, tokenizer))


async def _serve_jobs(sock: socket.socket, cfg: AgentConfig, tokenizer) -> None:
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
    running: asyncio.Task | None = None

    async def read() -> None:
        while True:
            message = await link.receive()
            if message is None or message[0] == CLOSE:  # closed, or the worker's process is gone: stop, mid-job too
                if running is not None:
                    running.cancel()
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
            running = asyncio.create_task(JOBS[name](agent, engine, *args))
            try:
                with frozen_heap():
                    link.send((RESULT, await running))
            except asyncio.CancelledError:
                break
            except Exception:
                link.send((FAILED, traceback.format_exc()))
            finally:
                beat.cancel()
            try:
                await writer.drain()
            except ConnectionError:  # the worker's process is gone
                break
    finally:
        reading.cancel()
        agent.close()
        writer.close()


async def _heartbeat(link: _Link) -> None:
    while True:
        await asyncio.sleep(HEARTBEAT_S)
        link.send((BEAT,))
