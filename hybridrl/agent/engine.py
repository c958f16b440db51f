"""What the agent loop needs from an engine (token ids in, token ids and log-probs out), and the fallback adapter.

The loop awaits one generation at a time per trajectory::

    completion = await engine.generate(GenerationRequest(context_ids, prompt_index, sample_index), params)

`as_async_engine` picks what serves those awaits, in this order:

1. an engine whose `generate` is itself a coroutine taking a request (an `AsyncGenerator`);
2. the engine's own continuous batching, where `engine.async_engine(longest)` offers it (`ContinuousEngine`): the
   native fused engine's `AsyncEngine`, vLLM's and SGLang's request streams. Requests join the running batch as
   they arrive and leave when done, so a trajectory waiting on a tool, or generating a long turn, never holds the
   others back;
3. the fallback, `TurnBatchingAdapter`, for an engine with only the synchronous request API,
   `generate_requests(requests, params)` (the native transformers path; an engine of TP size > 1 outside its
   leader's `lead`, where each rank would add requests at its own moments). It collects the requests of all live
   trajectories and runs them as one batch once every live trajectory is waiting on the engine: a barrier per turn,
   so trajectories that finish a turn early (no tool call, a quick tool) wait for the slowest tool of that turn
   before the next batch starts.

With engine.tp_size > 1 the worker's generate phase runs the loop on the TP leader only, inside `engine.lead(group)`,
while the other ranks `engine.follow(group)` (`hybridrl.engines.lockstep`): one schedule for the group, continuously
batched, and each tool call made once per group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams


@runtime_checkable
class AsyncGenerator(Protocol):
    """An engine the loop can await per request (continuous batching)."""

    async def generate(self, request: GenerationRequest, params: SamplingParams) -> Completion:
        """One sample continuing `request.prompt_ids`, drawn from the stream keyed by (params.seed,
        request.prompt_index, request.sample_index); `params.n` is 1."""
        ...


@runtime_checkable
class RequestEngine(Protocol):
    """The synchronous request-level API (vLLM's `LLM.generate`, the native engine's batch call)."""

    def generate_requests(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        """One completion per request, in order."""
        ...


@runtime_checkable
class ContinuousEngine(Protocol):
    """An engine that can serve the loop's requests one by one, joining its running batch (continuous batching)."""

    def async_engine(self, longest: int | None = None) -> AsyncGenerator | None:
        """An `AsyncGenerator` over this engine for one event loop (one generate phase), or None where the engine
        cannot take requests one at a time here (it then gets `TurnBatchingAdapter`). `longest`: the most tokens any
        request's context plus its new tokens will reach (`agent.max_total_tokens`), for engines that size their KV
        cache up front. A stream that must be awaited on a particular event loop names it as its `event_loop`."""
        ...


@runtime_checkable
class LaneAware(Protocol):
    """Engines (adapters) that must know how many callers are live. The loop runs trajectories in lanes (one lane
    runs its trajectories one after another) and calls `join` for every lane before any lane starts, and `leave`
    when a lane has no trajectory left."""

    def join(self) -> None: ...

    def leave(self) -> None: ...


def _batch_key(params: SamplingParams) -> tuple:
    """Requests that may share one batch call: equal sampling parameters except the token cap."""
    return (params.temperature, params.top_p, params.top_k, tuple(params.stop_token_ids), params.seed)


def cap_completion(c: Completion, max_new_tokens: int) -> Completion:
    """`c` cut to `max_new_tokens` tokens (then finish_reason 'length'). Exact for engines whose token k depends only
    on the context and the stream (seed, prompt, sample, k), as every engine here does: a longer cap only adds
    tokens after the ones the shorter cap would have returned."""
    if len(c.token_ids) <= max_new_tokens:
        return c
    return Completion(c.prompt_index, c.token_ids[:max_new_tokens], c.logprobs[:max_new_tokens], "length")


class TurnBatchingAdapter:
    """The fallback: `AsyncGenerator` over a synchronous `RequestEngine`, one batch per turn (see the module doc).

    Pending requests are grouped by their sampling parameters except `max_new_tokens` (the loop varies the cap near
    the token budget); each group runs with its largest cap and each completion is cut back to its own
    (`cap_completion`). The engine call runs on the event-loop thread: when it runs, every live trajectory is
    waiting on it, so there is nothing else to do, and engines keep the thread they were built on.
    """

    def __init__(self, engine: RequestEngine) -> None:
        self.engine = engine
        self.live = 0
        self.batches = 0
        self._pending: list[tuple[GenerationRequest, SamplingParams, asyncio.Future]] = []

    def join(self) -> None:
        """One more lane will call `generate` (the loop joins every lane before any starts)."""
        self.live += 1

    def leave(self) -> None:
        """A lane is done; the requests of the others may now be all there is to wait for."""
        self.live -= 1
        self._maybe_flush()

    async def generate(self, request: GenerationRequest, params: SamplingParams) -> Completion:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((request, params, fut))
        self._maybe_flush()
        return await fut

    def _maybe_flush(self) -> None:
        if not self._pending or len(self._pending) < self.live:
            return
        pending, self._pending = self._pending, []
        groups: dict[tuple, list[tuple[GenerationRequest, SamplingParams, asyncio.Future]]] = {}
        for item in pending:
            groups.setdefault(_batch_key(item[1]), []).append(item)
        for items in groups.values():
            cap = max(p.max_new_tokens for _, p, _ in items)
            params = dataclasses.replace(items[0][1], n=1, max_new_tokens=cap)
            try:
                outs = self.engine.generate_requests([r for r, _, _ in items], params)
                if len(outs) != len(items):
                    raise RuntimeError(f"generate_requests returned {len(outs)} completions for {len(items)} requests")
            except BaseException as e:  # every waiting trajectory must learn of it, not hang
                for _, _, fut in items:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            self.batches += 1
            for (_, p, fut), c in zip(items, outs):
                if not fut.done():
                    fut.set_result(cap_completion(c, p.max_new_tokens))


async def settle(gen: object, abandon: bool = False) -> None:
    """Return once `gen` has stopped touching its engine, where it can say so (`idle`: the native engine's driver
    may still read a step it launched ahead after the last completion). Call it before the engine sleeps; `abandon`
    when the rollout failed (what still runs is dropped)."""
    idle = getattr(gen, "idle", None)
    if idle is not None:
        await idle(abandon)


async def gather_settled(gen: object, lanes: list) -> None:
    """Run the trajectory `lanes` to their end, then `settle(gen)`; if one fails, abandon the rest first."""
    try:
        await asyncio.gather(*lanes)
    except BaseException:
        await settle(gen, abandon=True)
        raise
    await settle(gen)


def as_async_engine(engine: object, longest: int | None = None) -> AsyncGenerator:
    """What serves the loop's requests (see the module docstring): `engine` itself when its `generate` is a coroutine
    function taking a request; its `async_engine(longest)` where it offers one; `TurnBatchingAdapter(engine)` when it
    has `generate_requests`; otherwise a TypeError saying what is missing."""
    gen = getattr(engine, "generate", None)
    if gen is not None and inspect.iscoroutinefunction(gen):
        return engine  # type: ignore[return-value]
    make = getattr(engine, "async_engine", None)
    if callable(make):
        continuous = make(longest)
        if continuous is not None:
            return continuous
    if callable(getattr(engine, "generate_requests", None)):
        return TurnBatchingAdapter(engine)  # type: ignore[arg-type]
    raise TypeError(
        f"{type(engine).__name__} offers neither `async generate(request, params)`, `async_engine()` nor "
        "`generate_requests(requests, params)`; the agent loop needs one of them"
    )
