"""SGLang's partial rollouts: every request through SGLang's request API, stopped once enough groups are complete.

    outs = sgl.loop.run_until_complete(run_partial(sgl, requests, input_ids, sampling, groups, need, wait_for))
    # sgl: the sglang.Engine; input_ids, sampling: build_turn_requests' (each request's own max_new_tokens)

Each request is one `Engine.async_generate` call under a request id of ours (`rid`), so SGLang's scheduler batches
them continuously. As each returns, it counts down its group (`GroupCountdown`); once `need` groups are complete and
the `wait_for` requests finished, the others are aborted by id (`TokenizerManager.abort_request(rid)`, what the
server's `/abort_request` calls). SGLang answers an aborted request like a finished one, with finish_reason
{"type": "abort"} and the tokens it sampled so far with their log-probs (`output_ids`, `output_token_logprobs`: a
running request is stopped after its next decode step, a waiting one comes back empty); those come back here with
finish_reason 'partial'. A request that finishes on its own between the decision and its abort comes back whole.

SGLang 0.5.23 behaviour this relies on, read from its source: `Engine.async_generate(..., rid=...)`;
`Scheduler.abort_request` (a running request gets `to_finish = FINISH_ABORT()`, no status code; a waiting one is
removed and answered by `TokenizerManager._handle_abort_req` with its empty output); an abort without a status code
is yielded as the request's output rather than raised (`TokenizerManager._handle_abort_finish_reason`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

from hybridrl.engines.base import Completion, GenerationRequest, GroupCountdown
from hybridrl.engines.sglang.requests import parse_turn_outputs

ABORT_TIMEOUT_S = 300.0
"""How long the aborted requests may take to come back (each runs at most one more decode step) before the call
fails."""


async def run_partial(
    engine: Any,
    requests: Sequence[GenerationRequest],
    input_ids: Sequence[list[int]],
    sampling: Sequence[dict[str, Any]],
    groups: Sequence[object],
    need: int,
    wait_for: Sequence[int] = (),
) -> list[Completion]:
    """One completion per request, in order (`RolloutEngine.generate_partial`), on `engine`'s own event loop.
    `engine`: the `sglang.Engine` (or a stand-in with `async_generate` and `tokenizer_manager.abort_request`);
    `input_ids[i]`, `sampling[i]`: request i's SGLang inputs (its seed and its own `max_new_tokens`)."""
    countdown = GroupCountdown(groups, need, wait_for)
    outputs: list[Any] = [None] * len(requests)
    # SGLang aborts every request whose id starts with the one given: ids of one width, none a prefix of another.
    call = uuid.uuid4().hex
    rids = [f"hybridrl-partial-{call}-{i:07d}" for i in range(len(requests))]
    tasks: dict[asyncio.Task, int] = {}
    for i, (ids, sp) in enumerate(zip(input_ids, sampling, strict=True)):
        if sp["max_new_tokens"] == 0:  # nothing left to sample: finished before it starts
            outputs[i] = {"output_ids": [], "meta_info": {"finish_reason": {"type": "length"}}}
            countdown.finish(i)
            continue
        coro = engine.async_generate(input_ids=ids, sampling_params=sp, return_logprob=True, rid=rids[i])
        tasks[asyncio.ensure_future(coro)] = i
    pending = set(tasks)
    try:
        while pending and not countdown.done:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                outputs[tasks[task]] = task.result()
                countdown.finish(tasks[task])
        if pending:
            for task in pending:
                engine.tokenizer_manager.abort_request(rid=rids[tasks[task]])
            done, late = await asyncio.wait(pending, timeout=ABORT_TIMEOUT_S)
            if late:
                raise TimeoutError(f"SGLang answered {len(late)} aborted requests in none of {ABORT_TIMEOUT_S:.0f} s")
            for task in done:
                outputs[tasks[task]] = task.result()
            pending = set()
    finally:
        for task in pending:  # failed: nothing of this call is left running in SGLang or on the loop
            engine.tokenizer_manager.abort_request(rid=rids[tasks[task]])
            task.cancel()
    return parse_turn_outputs(outputs, requests, abort_as="partial")
