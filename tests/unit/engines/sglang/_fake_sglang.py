"""A stand-in for `sglang.Engine` (0.5.23 method names and signatures) that records every call.

Generation is a pure function of (input ids, sampling dict), so a test can predict every rank's completions; weight
payloads are deserialized the way SGLang's schedulers do (`hybridrl.engines.sglang.payload.deserialize` uses
SGLang's allow-list unpickler when sglang is importable) and recorded per TP rank.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams
from hybridrl.engines.sglang import payload as wire
from hybridrl.engines.sglang.requests import build_requests, build_turn_requests

FAIL_NAME = "fail.me.weight"  # a push containing this name is refused, like SGLang's (False, message)


def fake_sample(input_ids: list[int], sp: dict[str, Any]) -> tuple[list[int], list[float], str]:
    """Tokens, log-probs and finish type of one request: a pure function of its inputs and seed."""
    seed = sp.get("sampling_seed")
    base = sum(input_ids) * 31 + (0 if seed is None else seed % 1009)
    if sp["temperature"] == 0:
        base = sum(input_ids) * 31
    ids, stop = [], set(sp.get("stop_token_ids") or ())
    for k in range(sp["max_new_tokens"]):
        ids.append((base + 7 * k) % 50 + 100)
        if ids[-1] in stop:
            return ids, [-(j + 1) / 10 for j in range(len(ids))], "stop"
    return ids, [-(j + 1) / 10 for j in range(len(ids))], "length"


def expected_completions(prompts: list[list[int]], params: SamplingParams, stop_ids: list[int]) -> list[Completion]:
    """What a rank must get back from the adapter for its own prompts."""
    ids, sps = build_requests(prompts, params, stop_ids)
    out = []
    for k, (x, sp) in enumerate(zip(ids, sps, strict=True)):
        toks, lps, finish = fake_sample(x, sp)
        out.append(Completion(k // params.n, toks, lps, finish))
    return out


def expected_turns(requests: list[GenerationRequest], params: SamplingParams, stop_ids: list[int]) -> list[Completion]:
    """What a rank must get back for requests (the request form: one sample each, under its prompt_index)."""
    ids, sps = build_turn_requests(requests, params, stop_ids)
    out = []
    for r, x, sp in zip(requests, ids, sps, strict=True):
        toks, lps, finish = fake_sample(x, sp)
        out.append(Completion(r.prompt_index, toks, lps, finish))
    return out


def _output(input_ids: list[int], sp: dict[str, Any]) -> dict[str, Any]:
    toks, lps, finish = fake_sample(input_ids, sp)
    meta = {
        "finish_reason": {"type": finish, "matched": toks[-1]}
        if finish == "stop"
        else {"type": finish, "length": len(toks)},
        "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, toks, strict=True)],
        "prompt_tokens": len(input_ids),
        "completion_tokens": len(toks),
    }
    return {"output_ids": toks, "meta_info": meta}


class FakeSglangEngine:
    """Records `calls` as (method, arguments, start time, end time); `pushes` as per-push lists of
    per-TP-rank [(name, dtype, shape, first value)]."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[str, dict[str, Any], float, float]] = []
        self.pushes: list[list[list[tuple[str, str, list[int], float]]]] = []
        self.received: list[list[list[tuple[str, Any]]]] = []  # per push, per TP rank: (name, tensor copy)
        self.released: set[str] = set()
        self.session = False
        self.delay = {"release_memory_occupation": 0.3}  # seconds; lets tests see who waits for whom
        self.async_delay = 0.0
        self.token_delay = 0.0  # seconds per generated token of async_generate (0: answered at once)
        self.aborted: list[str] = []  # rids passed to tokenizer_manager.abort_request, in order
        self.running: set[str] = set()  # rids of async_generate calls not answered yet
        self.tokenizer_manager = SimpleNamespace(abort_request=self._abort_request)
        self.loop = asyncio.new_event_loop()  # as sglang.Engine: the loop its tokenizer manager serves requests on
        self._record("__init__", kwargs, time.time())

    def _record(self, name: str, args: dict[str, Any], t0: float) -> None:
        self.calls.append((name, args, t0, time.time()))

    def generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        image_data=None,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        stream=False,
        rid=None,
    ):
        t0 = time.time()
        assert prompt is None and return_logprob and not stream
        if image_data is not None:  # SGLang: one entry per request (GenerateReqInput._normalize_image_data)
            assert len(image_data) == len(input_ids)
        out = [_output(x, sp) for x, sp in zip(input_ids, sampling_params, strict=True)]
        args = dict(input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob)
        if image_data is not None:
            args["image_data"] = image_data
        self._record("generate", args, t0)
        return out

    async def async_generate(
        self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False, rid=None, **kw
    ):
        """One request (flat input ids, one sampling dict), answered after `async_delay` seconds plus `token_delay`
        per token on `self.loop`. Aborted by its `rid` (`tokenizer_manager.abort_request`), it is answered as SGLang
        answers an aborted running request: after its next token, with finish_reason {"type": "abort"} and the
        tokens and log-probs so far."""
        t0 = time.time()
        assert prompt is None and return_logprob and not kw.get("stream")
        assert asyncio.get_running_loop() is self.loop, "SGLang answers only on the loop its engine was made on"
        self.running.add(rid)
        try:
            await asyncio.sleep(self.async_delay)
            out = _output(input_ids, sampling_params)
            for k in range(len(out["output_ids"])):
                await asyncio.sleep(self.token_delay)
                aborted = rid is not None and any(rid.startswith(prefix) for prefix in self.aborted)  # as SGLang
                if aborted and k + 1 < len(out["output_ids"]):
                    meta = dict(out["meta_info"], finish_reason={"type": "abort", "message": "Aborted"})
                    meta["output_token_logprobs"] = meta["output_token_logprobs"][: k + 1]
                    out = {"output_ids": out["output_ids"][: k + 1], "meta_info": meta}
                    break
        finally:
            self.running.discard(rid)
        args = dict(input_ids=input_ids, sampling_params=sampling_params, rid=rid)
        if kw.get("image_data") is not None:
            args["image_data"] = kw["image_data"]
        self._record("async_generate", args, t0)
        return out

    def _abort_request(self, rid: str = "", abort_all: bool = False):
        """`TokenizerManager.abort_request`: the request `rid` stops after its next token."""
        assert rid and not abort_all
        self.aborted.append(rid)

    def release_memory_occupation(self, tags=None):
        t0 = time.time()
        time.sleep(self.delay.get("release_memory_occupation", 0))
        self.released |= set(tags or ("weights", "kv_cache", "cuda_graph"))
        self._record("release_memory_occupation", dict(tags=tags), t0)

    def resume_memory_occupation(self, tags=None):
        t0 = time.time()
        for tag in tags or ("weights", "kv_cache", "cuda_graph"):
            self.released.remove(tag)  # KeyError for a tag not released, as in SGLang
        self._record("resume_memory_occupation", dict(tags=tags), t0)

    def begin_weight_update(self, selector: str = "all"):
        t0 = time.time()
        ok = not self.session
        self.session = True
        self._record("begin_weight_update", dict(selector=selector), t0)
        return (True, "Success") if ok else (False, "a weight update session is already open")

    def end_weight_update(self):
        t0 = time.time()
        ok, self.session = self.session, False
        self._record("end_weight_update", {}, t0)
        return (True, "Success") if ok else (False, "no weight update session is open")

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        t0 = time.time()
        record, received = [], []
        for data in named_tensors:  # a payload can be unpickled once (it carries handles, not bytes)
            tensors = wire.reconstruct(wire.deserialize(data))
            record.append([(n, str(t.dtype), list(t.shape), float(t.flatten()[0])) for n, t in tensors])
            received.append([(n, t.clone()) for n, t in tensors])
        self.pushes.append(record)
        self.received.append(received)
        self._record(
            "update_weights_from_tensor",
            dict(named_tensors=named_tensors, load_format=load_format, flush_cache=flush_cache),
            t0,
        )
        if not self.session:
            return False, "update_weights_from_tensor needs an open weight update session"
        if any(n == FAIL_NAME for rank in record for n, *_ in rank):
            return False, f"refused {FAIL_NAME}"
        return True, "Success"

    def flush_cache(self):
        t0 = time.time()
        self._record("flush_cache", {}, t0)
        return SimpleNamespace(success=True, message="")  # like FlushCacheReqOutput

    def shutdown(self):
        t0 = time.time()
        self.loop.close()
        self._record("shutdown", {}, t0)
