"""Scripted engines for tests of the agent loop: fixed token streams per (prompt, sample, turn), no model.

    engine = ScriptedAsyncEngine({(0, 0, 0): ids_with_a_tool_call, (0, 0, 1): ids_of_the_answer}, stop_ids=[eos])

The turn of a request is how many requests that (prompt_index, sample_index) has made before. Each scripted
stream is cut at its first stop id (kept; finish 'stop') or at the request's `max_new_tokens` (finish 'length');
a stream that runs out without a stop id ends 'length'. Log-probs are `scripted_logprob(prompt, sample, turn, k)`,
distinct per position so tests can check their alignment.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams

Script = Mapping[tuple[int, int, int], Sequence[int]] | Callable[[int, int, int], Sequence[int]]


def scripted_logprob(prompt_index: int, sample_index: int, turn: int, k: int) -> float:
    """The log-prob the scripted engines report for token k of a turn (negative, distinct per position)."""
    return -(1.0 + turn + 0.01 * k + 0.1 * sample_index + 0.001 * prompt_index)


class ScriptedEngine:
    """The synchronous request API (`generate_requests`) over a script; records every request and batch."""

    def __init__(self, script: Script, stop_ids: Sequence[int], default: Sequence[int] | None = None) -> None:
        """`default`: the stream of any (prompt, sample, turn) the script lacks (default: just the first stop id)."""
        self.script, self.stop_ids = script, set(stop_ids)
        self.default = list(default) if default is not None else [list(stop_ids)[0]]
        self.turn_of: dict[tuple[int, int], int] = defaultdict(int)
        self.requests: list[tuple[GenerationRequest, SamplingParams, int]] = []
        self.batch_sizes: list[int] = []

    def stream(self, prompt_index: int, sample_index: int, turn: int) -> list[int]:
        if callable(self.script):
            return list(self.script(prompt_index, sample_index, turn))
        return list(self.script.get((prompt_index, sample_index, turn), self.default))

    def complete(self, request: GenerationRequest, params: SamplingParams) -> Completion:
        """One request: its turn's stream, cut at a stop id or the token cap."""
        key = (request.prompt_index, request.sample_index)
        turn = self.turn_of[key]
        self.turn_of[key] += 1
        self.requests.append((request, params, turn))
        ids = self.stream(*key, turn)
        out, reason = [], "length"
        for tok in ids:
            if len(out) == params.max_new_tokens:
                break
            out.append(tok)
            if tok in self.stop_ids:
                reason = "stop"
                break
        lps = [scripted_logprob(*key, turn, k) for k in range(len(out))]
        return Completion(request.prompt_index, out, lps, reason)

    def generate_requests(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        self.batch_sizes.append(len(requests))
        return [self.complete(r, params) for r in requests]


class ScriptedAsyncEngine(ScriptedEngine):
    """The same script behind `async generate(request, params)`, answering each request after `delay_s`."""

    def __init__(
        self, script: Script, stop_ids: Sequence[int], default: Sequence[int] | None = None, delay_s: float = 0.0
    ) -> None:
        super().__init__(script, stop_ids, default)
        self.delay_s = delay_s

    async def generate(self, request: GenerationRequest, params: SamplingParams) -> Completion:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return self.complete(request, params)
