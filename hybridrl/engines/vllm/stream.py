"""Agent turns on vLLM's own continuous batching: requests added one at a time to the in-process engine, which one
driver task steps.

    stream = engine.async_engine()                  # VllmEngine, engine.tp_size == 1: one per generate phase
    completion = await stream.generate(GenerationRequest(context, prompt_index, sample_index), params)

Each `generate` adds its request to the in-process engine (`LLMEngine.add_request`: vLLM's scheduler admits it at its
next step) and awaits it; the driver runs `LLMEngine.step()` while requests are unfinished, yielding to the event loop
between steps, so a turn back from its tool joins the running batch at the next step, and one trajectory's tool call
or long turn never holds up another's. It is the request stream `LLM.generate` itself runs (add every request, then
step until done; final outputs only), with requests arriving while it runs. vLLM's asyncio engine (`AsyncLLM`) would
run the engine core in a process of its own; the colocated engine runs in the worker's process (external_launcher),
so its steps are driven here.

With engine.tp_size > 1 every rank of the TP group must make the same calls in the same order (each rank is a full
engine sharing only the TP collectives) while each rank's tools would finish at their own times: the TP leader's
stream sends each step's new requests to the other ranks before the step (`engines/lockstep.py`), and they add the
same requests and take the same step (`replay`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams
from hybridrl.engines.lockstep import DONE, STEP, Lockstep


class VllmRequestStream:
    """`await generate(request, params)` from any number of coroutines of one event loop, over one vLLM `LLM`."""

    def __init__(
        self,
        llm: Any,
        params_of: Callable[[SamplingParams, GenerationRequest], Any],
        completion_of: Callable[[int, Any], Completion],
        lockstep: Lockstep | None = None,
    ) -> None:
        """`params_of(params, request)`: vLLM's SamplingParams of one request (its seed from the request's stream key);
        `completion_of(prompt_index, output)`: our Completion of a finished `RequestOutput`; `lockstep`: the TP group
        this rank leads (engine.tp_size > 1)."""
        from vllm.sampling_params import RequestOutputKind

        self.llm, self.params_of, self.completion_of, self.lockstep = llm, params_of, completion_of, lockstep
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._added: list[tuple[str, dict, Any]] = []  # added since the last step, for the TP group (lockstep)
        self.steps = 0  # engine steps taken (each one admits what was added before it)
        self._waiting: dict[str, tuple[asyncio.Future, int]] = {}
        self._driver: asyncio.Task | None = None
        self._ids = itertools.count()

    async def generate(self, request: GenerationRequest, params: SamplingParams) -> Completion:
        """One sample continuing `request.prompt_ids`, drawn from the stream keyed by (params.seed,
        request.prompt_index, request.sample_index), as `VllmEngine.generate_requests` draws it."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        sampling = self.params_of(params, request)
        sampling.output_kind = self._final_only  # one output per request, when it is done
        # Our own ids: outputs come back under the id given here (vLLM keys its internal copy with a random suffix).
        request_id = f"hybridrl-agent-{next(self._ids)}"
        prompt = {"prompt_token_ids": [int(t) for t in request.prompt_ids]}
        self.llm.llm_engine.add_request(request_id, prompt, sampling)
        if self.lockstep is not None:
            self._added.append((request_id, prompt, sampling))
        self._waiting[request_id] = (future, request.prompt_index)
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive())
        return await future

    async def _drive(self) -> None:
        engine = self.llm.llm_engine
        try:
            while True:
                await asyncio.sleep(0)  # coroutines woken by the last step enqueue their next turn first
                if not self._waiting:
                    return
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM holds none of the {len(self._waiting)} requests still awaited")
                if self.lockstep is not None:
                    self.lockstep.send(STEP, self._added)
                    self._added = []
                outputs = engine.step()
                self.steps += 1
                for out in outputs:
                    if not out.finished or out.request_id not in self._waiting:
                        continue
                    future, index = self._waiting.pop(out.request_id)
                    if future.done():
                        continue
                    try:
                        future.set_result(self.completion_of(index, out))
                    except Exception as e:  # a malformed output fails its own request only
                        future.set_exception(e)
        except BaseException as e:  # the engine failed (or the loop is closing): every waiter hears it, none hangs
            waiting, self._waiting = self._waiting, {}
            if waiting:
                try:
                    engine.abort_request(list(waiting))
                except Exception:  # noqa: BLE001 - the original failure is what the waiters must see
                    pass
            for future, _ in waiting.values():
                if not future.done():
                    future.set_exception(e)
            if not isinstance(e, Exception):
                raise


def replay(llm: Any, lockstep: Lockstep) -> int:
    """A TP follower's part of the leader's schedule: add the requests the leader added before each of its steps and
    take the same step, until the leader's phase ends. The outputs are the leader's to use; returns the steps taken."""
    engine, steps = llm.llm_engine, 0
    while True:
        kind, payload = lockstep.receive()
        if kind == DONE:
            return steps
        if kind == STEP:
            for request_id, prompt, sampling in payload:
                engine.add_request(request_id, prompt, sampling)
            engine.step()
            steps += 1
