"""An asyncio face for a native engine: many coroutines await completions while one driver task runs the engine.

    engine = AsyncEngine(fused_engine)                    # what FusedEngine.async_engine(longest) returns
    async def trajectory(...):
        out = await engine.generate(GenerationRequest(context, prompt_index, sample_index), params)
        ... run a tool (await), extend the context, generate again ...
    await asyncio.gather(*(trajectory(...) for ...))

With the fused engine (continuous batching) each `generate` submits its request at once and the driver steps the
engine while anything runs, yielding to the event loop between steps, so a request joins the running batch at the
next step and one trajectory's tool call never holds up the others. An engine without `submit`/`step` (the HF path)
is served per batch: the requests that arrived since its last call go into one `generate_requests`.
On the CPU the driver runs the engine in the event loop's thread: a step blocks it for one decode step, and
there is nothing to overlap. On a GPU it runs in a thread of its own (`threaded`): the engine launches each step one
ahead of reading its tokens, so the device stays busy as long as the host keeps up, and in the loop's thread the
coroutines' own work between turns (decoding, parsing, starting tools, rendering the tool turn) would delay every
launch; in a thread it runs while the driver waits on the device. The driver submits what the coroutines queued
before each step and hands completions back to the loop (`call_soon_threadsafe`); it ends when nothing is left and
starts again with the next request. With engine.tp_size > 1 every rank must build the same batches: the TP leader's
stream sends each step's new requests to the other ranks (`engines/lockstep.py`), which replay them (`replay`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

import torch

from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams
from hybridrl.engines.lockstep import DONE, SIZE, STEP, Lockstep
from hybridrl.engines.native.frozen_heap import frozen_heap
from hybridrl.errors import HybridRLError

#: How long `idle` waits for the driver's last step (a decode step takes milliseconds).
IDLE_DEADLINE_S = 60.0


class AsyncEngine:
    """`await generate(request, params)` from any number of coroutines of one event loop."""

    def __init__(self, engine, lockstep: Lockstep | None = None, threaded: bool = False) -> None:
        """`lockstep`: the TP group this engine leads (engine.tp_size > 1): each step's new requests go to the other
        ranks before the step. `threaded`: step a continuous engine in a driver thread (a GPU engine) instead of
        in the event loop's thread."""
        self.engine, self.lockstep = engine, lockstep
        self.continuous = hasattr(engine, "submit") and hasattr(engine, "step")
        self.threaded = threaded and self.continuous
        self._futures: dict[int, asyncio.Future] = {}
        self._queued: list[tuple[GenerationRequest, SamplingParams, asyncio.Future]] = []
        self._added: list[tuple[GenerationRequest, SamplingParams]] = []  # submitted since the last step (lockstep)
        self._driver: asyncio.Task | None = None
        # The threaded driver: requests the coroutines queued, taken by the driver before each step.
        self._inbox: deque[tuple[GenerationRequest, SamplingParams, asyncio.Future]] = deque()
        self._inbox_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._abandoned = False  # `idle(abandon=True)`: the driver stops at its next step

    async def generate(self, request: GenerationRequest, params: SamplingParams) -> Completion:
        """The completion of one request (params.n is ignored), keyed like `generate_requests`: the same request
        and seed give the same tokens however the requests in flight are batched."""
        future = asyncio.get_running_loop().create_future()
        if self.threaded:
            self._hand_over(request, params, future)
            return await future
        if self.continuous:
            self._futures[self.add(request, params)] = future
        else:
            self._queued.append((request, params, future))
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        return await future

    def _busy(self) -> bool:
        return self.engine.has_work if self.continuous else bool(self._queued)

    async def _drive(self) -> None:
        try:
            with frozen_heap():  # the garbage collector's full passes skip what lived before the rollout
                while True:
                    await asyncio.sleep(0)  # coroutines woken by the last step submit their next turn first
                    if not self._busy():
                        return
                    if self.continuous:
                        for handle, completion in self.advance():
                            future = self._futures.pop(handle)
                            if not future.done():
                                future.set_result(completion)
                    else:
                        self._run_queued()
        except BaseException as e:  # the engine failed: every waiter hears it, none hangs
            waiting = list(self._futures.values()) + [f for _, _, f in self._queued]
            self._futures.clear()
            self._queued.clear()
            for future in waiting:
                if not future.done():
                    future.set_exception(e)
            if not isinstance(e, Exception):
                raise

    async def idle(self, abandon: bool = False) -> None:
        """Return once the engine has stopped stepping: after the last completion a GPU engine may still read a step
        it launched ahead, and nothing else may touch the engine (sleep, a weight update) before it has. `abandon`
        (the rollout failed): the driver stops after its current step, leaving what runs to the engine's next
        sleep, which drops it."""
        if self.threaded:
            with self._inbox_lock:
                self._abandoned = abandon
                thread = self._thread
            if thread is not None:
                await asyncio.to_thread(thread.join, IDLE_DEADLINE_S)
                if thread.is_alive():
                    raise HybridRLError(f"native engine: its driver did not stop within {IDLE_DEADLINE_S} s")
        elif self._driver is not None and not self._driver.done():
            if abandon:
                self._driver.cancel()
            await asyncio.gather(self._driver, return_exceptions=True)

    # -- driving the engine from outside (a process serving another's requests) ----------------------------
    @property
    def busy(self) -> bool:
        """Whether a request added or submitted has not come back from `advance` yet."""
        return self.engine.has_work

    def add(self, request: GenerationRequest, params: SamplingParams) -> int:
        """Submit one request (continuous engines); its completion comes back from `advance` under the returned
        handle. With a lockstep it goes to the other ranks before the next step. Raises for a bad request."""
        handle = self.engine.submit(request, params)
        if self.lockstep is not None:
            self._added.append((request, params))
        return handle

    def advance(self) -> list[tuple[int, Completion]]:
        """One engine step (the requests added since the last one sent to the other ranks first): the completions
        that finished, with their handles."""
        if self.lockstep is not None:
            self.lockstep.send(STEP, self._added)
            self._added = []
        return self.engine.step()

    # -- the driver thread (threaded) ------------------------------------------------------------------------
    def _hand_over(self, request: GenerationRequest, params: SamplingParams, future: asyncio.Future) -> None:
        with self._inbox_lock:
            self._inbox.append((request, params, future))
            if self._thread is None:  # the driver ended (or never ran): start one
                self._thread = threading.Thread(
                    target=self._drive_thread, args=(future.get_loop(), _device_of(self.engine)), daemon=True
                )
                self._thread.start()

    def _take_inbox(self) -> bool:
        """Submit what the coroutines queued; False (and the driver ends) when that and the engine are empty."""
        with self._inbox_lock:
            taken = list(self._inbox)
            self._inbox.clear()
            if self._abandoned or (not taken and not self.engine.has_work):
                self._thread = None
                return False
        for request, params, future in taken:
            try:
                self._futures[self.add(request, params)] = future
            except Exception as e:  # this request was bad (an empty prompt, too long): only its waiter hears it
                future.get_loop().call_soon_threadsafe(_settle, future, None, e)
        return True

    def _drive_thread(self, loop: asyncio.AbstractEventLoop, device: int | None) -> None:
        try:  # anything failing here, setting the device included, reaches every waiter: none hangs
            if device is not None:
                torch.cuda.set_device(device)  # the current device is per thread
            with frozen_heap(), torch.inference_mode():
                while self._take_inbox():
                    if not self.engine.has_work:
                        continue
                    done = self.advance()
                    if done:
                        loop.call_soon_threadsafe(_settle_all, [(self._futures.pop(h), c) for h, c in done])
        except BaseException as e:  # the engine failed: every waiter hears it, none hangs
            with self._inbox_lock:
                waiting = list(self._futures.values()) + [f for _, _, f in self._inbox]
                self._futures.clear()
                self._inbox.clear()
                self._thread = None
            loop.call_soon_threadsafe(_settle_all, [(f, None) for f in waiting], e)

    def _run_queued(self) -> None:
        queued, self._queued = self._queued, []
        start = 0
        while start < len(queued):  # consecutive requests with equal params go in one call
            end = start + 1
            while end < len(queued) and queued[end][1] == queued[start][1]:
                end += 1
            outs = self.engine.generate_requests([r for r, _, _ in queued[start:end]], queued[start][1])
            for (_, _, future), out in zip(queued[start:end], outs):
                if not future.done():
                    future.set_result(out)
            start = end


def _device_of(engine) -> int | None:
    """The CUDA device index the engine runs on (None off CUDA), resolved in the calling thread: an engine on
    `torch.device("cuda")` runs on the caller's current device, which a new thread does not inherit."""
    device = getattr(engine, "device", None)
    if not isinstance(device, torch.device) or device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def _settle(future: asyncio.Future, result: Completion | None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _settle_all(results: list[tuple[asyncio.Future, Completion | None]], error: BaseException | None = None) -> None:
    for future, result in results:
        _settle(future, result, error)


def replay(engine, lockstep: Lockstep) -> int:
    """A TP follower's part of the leader's schedule (`engines/lockstep.py`): size the engine as the leader did, add
    the requests the leader added before each of its steps and take the same step, until the leader's phase ends.
    The completions are the leader's to use; returns the steps taken."""
    steps = 0
    with frozen_heap():
        while True:
            kind, payload = lockstep.receive()
            if kind == DONE:
                return steps
            if kind == SIZE:
                engine.size_for(payload)
            elif kind == STEP:
                for request, params in payload:
                    engine.submit(request, params)
                engine.step()
                steps += 1
