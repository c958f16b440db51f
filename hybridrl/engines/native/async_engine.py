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
The driver runs the engine in the event loop's thread (a step blocks it for one decode step). With
engine.tp_size > 1 every rank must build the same batches: the TP leader's stream sends each step's new requests to
the other ranks (`engines/lockstep.py`), which replay them (`replay`).
"""

from __future__ import annotations

import asyncio

from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams
from hybridrl.engines.lockstep import DONE, SIZE, STEP, Lockstep
from hybridrl.engines.native.frozen_heap import frozen_heap


class AsyncEngine:
    """`await generate(request, params)` from any number of coroutines of one event loop."""

    def __init__(self, engine, lockstep: Lockstep | None = None) -> None:
        """`lockstep`: the TP group this engine leads (engine.tp_size > 1): each step's new requests go to the other
        ranks before the step."""
        self.engine, self.lockstep = engine, lockstep
        self.continuous = hasattr(engine, "submit") and hasattr(engine, "step")
        self._futures: dict[int, asyncio.Future] = {}
        self._queued: list[tuple[GenerationRequest, SamplingParams, asyncio.Future]] = []
        self._added: list[tuple[GenerationRequest, SamplingParams]] = []  # submitted since the last step (lockstep)
        self._driver: asyncio.Task | None = None

    async def generate(self, request: GenerationRequest, params: SamplingParams) -> Completion:
        """The completion of one request (params.n is ignored), keyed like `generate_requests`: the same request
        and seed give the same tokens however the requests in flight are batched."""
        future = asyncio.get_running_loop().create_future()
        if self.continuous:
            self._futures[self.engine.submit(request, params)] = future
            if self.lockstep is not None:
                self._added.append((request, params))
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
                        if self.lockstep is not None:
                            self.lockstep.send(STEP, self._added)
                            self._added = []
                        for handle, completion in self.engine.step():
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
