"""vLLM's partial rollouts: add every request to the in-process engine, step it until enough groups are complete, then
abort the rest and hand back what each sampled so far.

    outs = run_partial(llm.llm_engine, requests, sampling, groups, need, wait_for)   # sampling[i]: vLLM's params

It is the request stream `LLM.generate` runs (add every request, step until none is unfinished) with two changes:
each request streams its new tokens and their log-probs at every step (`RequestOutputKind.DELTA`), so an unfinished
request's tokens so far are known, and after each step the finished requests count down their groups
(`GroupCountdown`); once `need` groups are complete, the `wait_for` requests finished and some unfinished request
still has a tail (more of its cap left than any request has sampled; with none it runs on to the end, so a rollout
without a tail samples what `LLM.generate` would), the others are aborted (`LLMEngine.abort_request`) and come back
with finish_reason 'partial'. A request's tokens depend only on its context and its seed, so a request that
finishes here draws what it draws run to its end.

With engine.tp_size > 1 every rank runs this on its own engine with the same requests: each rank's steps return the
same tokens (the same logits after the TP collectives, the same per-request seeds), which `LLM.generate` relies on
to end every rank's loop at the same step, so every rank stops, and aborts, after the same step as well.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from hybridrl.engines.base import Completion, GenerationRequest, GroupCountdown
from hybridrl.errors import HybridRLError

_calls = itertools.count()


def _has_tail(
    running: set[str], index: dict[str, int], tokens: list[list[int]], sampling: Sequence[Any], longest: int
) -> bool:
    """Whether some unfinished request's cap leaves more tokens than the `longest` any request has sampled (one
    still waiting counts its whole cap): only then does stopping save steps worth carrying a sample to the next
    weights (the native engine's rule, `engines/native/partial.has_tail`)."""
    return any(sampling[index[r]].max_tokens - len(tokens[index[r]]) > longest for r in running)


def run_partial(
    engine: Any,
    requests: Sequence[GenerationRequest],
    sampling: Sequence[Any],
    groups: Sequence[object],
    need: int,
    wait_for: Sequence[int] = (),
) -> list[Completion]:
    """One completion per request, in order (`RolloutEngine.generate_partial`). `engine`: vLLM's `LLMEngine` (in this
    process, nothing else running on it); `sampling[i]`: request i's vLLM SamplingParams (one sample, its seed and its
    own token cap), whose output kind is set here."""
    from vllm.sampling_params import RequestOutputKind

    if len(sampling) != len(requests) or len(groups) != len(requests):
        raise ValueError(f"{len(requests)} requests with {len(sampling)} sampling params and {len(groups)} groups")
    if engine.has_unfinished_requests():
        raise HybridRLError("vLLM engine: generate_partial while other requests run on it; finish or abort them first")
    countdown = GroupCountdown(groups, need, wait_for)
    tokens: list[list[int]] = [[] for _ in requests]
    logprobs: list[list[float]] = [[] for _ in requests]
    reasons: list[str | None] = [None] * len(requests)
    call = next(_calls)
    ids = [f"hybridrl-partial-{call}-{i}" for i in range(len(requests))]
    index = {request_id: i for i, request_id in enumerate(ids)}
    running: set[str] = set()
    try:
        for i, (request, sp) in enumerate(zip(requests, sampling, strict=True)):
            if sp.max_tokens == 0:  # nothing left to sample: finished before it starts (vLLM refuses max_tokens=0)
                reasons[i] = "length"
                countdown.finish(i)
                continue
            sp.output_kind = RequestOutputKind.DELTA  # each step's new tokens, so an unfinished request's are known
            engine.add_request(ids[i], {"prompt_token_ids": [int(t) for t in request.prompt_ids]}, sp)
            running.add(ids[i])
        longest = 0  # the most tokens a request of this call has sampled
        while running and not (countdown.done and _has_tail(running, index, tokens, sampling, longest)):
            for out in engine.step():
                i = index.get(out.request_id)
                if i is None or out.request_id not in running:
                    continue
                (sample,) = out.outputs
                new = list(sample.token_ids)
                tokens[i] += new
                longest = max(longest, len(tokens[i]))
                logprobs[i] += [pos[t].logprob for pos, t in zip(sample.logprobs or [], new, strict=True)]
                if out.finished:
                    if sample.finish_reason not in ("stop", "length"):
                        raise RuntimeError(f"vLLM request {i} finished with {sample.finish_reason!r}")
                    reasons[i] = sample.finish_reason
                    running.discard(out.request_id)
                    countdown.finish(i)
            if running and not engine.has_unfinished_requests():
                raise RuntimeError(f"vLLM holds none of the {len(running)} requests still running")
    finally:
        if running:  # stopped early, or failed: nothing of this call stays in the engine
            engine.abort_request(sorted(running))
    out = []
    for i, request in enumerate(requests):
        if len(logprobs[i]) != len(tokens[i]):
            raise RuntimeError(f"vLLM request {i}: {len(logprobs[i])} log-probs for {len(tokens[i])} tokens")
        out.append(Completion(request.prompt_index, tokens[i], logprobs[i], reasons[i] or "partial"))
    return out
