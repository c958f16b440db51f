"""Agent turns through SGLang's request API: each turn is one `Engine.async_generate` call, which joins SGLang's
running batch as it arrives (its scheduler batches continuously), so one trajectory's tool call or long turn never
holds up another's.

    stream = engine.async_engine()       # SglangEngine with engine.tp_size == 1: one per generate phase
    completion = await stream.generate(GenerationRequest(context, prompt_index, sample_index), params)

SGLang's tokenizer manager answers requests on the event loop it first served (`Engine.loop`, the one its blocking
calls run on), so the stream names that loop as its `event_loop` and the agent loop runs its trajectories there.
With engine.tp_size > 1 the leader's engine runs every TP rank: the leader runs the agent loop over this stream
(`SglangEngine.lead`) and the other ranks have nothing to do meanwhile (`follow`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams
from hybridrl.engines.sglang.multimodal import ImageTokens, build_image_data
from hybridrl.engines.sglang.requests import build_turn_requests, parse_turn_outputs


class SglangRequestStream:
    """`await generate(request, params)` from any number of coroutines on `event_loop`, over one `sglang.Engine`."""

    def __init__(self, engine: Any, stop_ids: Sequence[int], image_tokens: ImageTokens | None = None) -> None:
        """`engine`: the `sglang.Engine` (or a stand-in with `async_generate` and `loop`); `stop_ids`: the model's EOS
        ids, added to every request's stop ids; `image_tokens`: a vision-language model's placeholders (requests with
        images send them as `image_data`)."""
        self.engine, self.stop_ids, self.image_tokens = engine, list(stop_ids), image_tokens
        self.event_loop = engine.loop

    async def generate(self, request: GenerationRequest, params: SamplingParams) -> Completion:
        """One sample continuing `request.prompt_ids`, seeded from (params.seed, request.prompt_index,
        request.sample_index) as `SglangEngine.generate_requests` seeds it."""
        (input_ids,), (sampling,) = build_turn_requests([request], params, self.stop_ids)
        data = build_image_data([input_ids], [request.images], 1, self.image_tokens)
        extra = {"image_data": data[0]} if data is not None else {}
        out = await self.engine.async_generate(
            input_ids=input_ids, sampling_params=sampling, return_logprob=True, **extra
        )
        (completion,) = parse_turn_outputs([out], [request])
        return completion
