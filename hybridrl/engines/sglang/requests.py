"""Our SamplingParams → SGLang request dicts, and SGLang generate outputs → Completions.

SGLang conventions this relies on (sglang 0.5.23, read from its source):

- `sampling_params` keys: max_new_tokens, temperature, top_p, top_k (-1 = whole vocabulary), n, stop_token_ids,
  sampling_seed (`sampling/sampling_params.py`). temperature 0 becomes greedy (top_k=1, temperature 1).
- `meta_info["output_token_logprobs"]`: one `(logprob, token_id, text_or_None)` per generated token. The log-prob is
  log_softmax(logits / temperature) over the whole vocabulary, before top-k/top-p filtering — our definition — and
  log_softmax(logits) for greedy (`layers/sampler.py`). `SGLANG_RETURN_ORIGINAL_LOGPROB=1` would switch to unscaled
  logits, so the engine refuses to start with it set.
- `output_ids` runs through the stop token (a matched EOS/stop id is kept), like our Completion.
- `meta_info["finish_reason"]`: {"type": "stop"|"length"|"abort", ...}; an aborted request (`abort_request(rid)`)
  keeps the tokens and log-probs it sampled before the abort.
- `sampling_seed` is honoured only with `enable_deterministic_inference=True`; otherwise SGLang samples from the
  stream of its `random_seed`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams
from hybridrl.engines.sampling import stream_key

_SEED_MASK = 2**63 - 1  # SGLang accepts int64 seeds; keep them non-negative


def sample_seed(seed: int, global_prompt: int, sample: int) -> int:
    """The `sampling_seed` of sample `sample` of global prompt `global_prompt`: its stream key, folded to 63 bits."""
    return stream_key(seed, global_prompt, sample) & _SEED_MASK


def request_params(params: SamplingParams, prompt_index: int, sample: int, stop_ids: Sequence[int]) -> dict[str, Any]:
    """The SGLang `sampling_params` dict of one sample (n=1: we expand samples ourselves, one seed each)."""
    sp: dict[str, Any] = dict(
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        n=1,
        stop_token_ids=sorted(set(params.stop_token_ids) | set(stop_ids)),
    )
    if params.seed is not None:
        sp["sampling_seed"] = sample_seed(params.seed, params.prompt_offset + prompt_index, sample)
    return sp


def build_requests(
    prompts: Sequence[Sequence[int]], params: SamplingParams, stop_ids: Sequence[int]
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Input ids and sampling dicts, prompt-major: prompt i repeated n times (sample j gets its own seed)."""
    input_ids, sampling = [], []
    for i, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {i} is empty; SGLang needs at least one input token")
        for j in range(params.n):
            input_ids.append(ids)
            sampling.append(request_params(params, i, j, stop_ids))
    return input_ids, sampling


def build_turn_requests(
    requests: Sequence[GenerationRequest], params: SamplingParams, stop_ids: Sequence[int]
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Input ids and sampling dicts of requests (the request form: agent turns), one sample each, seeded from
    (seed, request.prompt_index, request.sample_index) as every engine seeds a request."""
    global_index = dataclasses.replace(params, prompt_offset=0)  # a request's prompt_index is global already
    input_ids, sampling = [], []
    for r in requests:
        ids = [int(t) for t in r.prompt_ids]
        if not ids:
            raise ValueError(
                f"request (prompt {r.prompt_index}, sample {r.sample_index}) is empty; SGLang needs a token"
            )
        input_ids.append(ids)
        sampling.append(request_params(global_index, r.prompt_index, r.sample_index, stop_ids))
    return input_ids, sampling


def parse_turn_outputs(
    outputs: Any, requests: Sequence[GenerationRequest], abort_as: str | None = None
) -> list[Completion]:
    """SGLang's outputs of `build_turn_requests`, each Completion under its request's prompt_index (`abort_as`: as
    in `parse_outputs`)."""
    out = parse_outputs(outputs, 1, len(requests), abort_as=abort_as)
    return [dataclasses.replace(c, prompt_index=r.prompt_index) for c, r in zip(out, requests, strict=True)]


def parse_outputs(outputs: Any, n: int, num_prompts: int, abort_as: str | None = None) -> list[Completion]:
    """SGLang's per-request dicts (prompt-major, n per prompt) as Completions. An aborted request is an error, unless
    `abort_as` names the finish_reason its tokens so far come back with (a partial rollout's 'partial')."""
    if isinstance(outputs, dict):  # a batch of one may come back unwrapped
        outputs = [outputs]
    if len(outputs) != n * num_prompts:
        raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {num_prompts} prompts x {n} samples")
    completions = []
    for k, out in enumerate(outputs):
        i = k // n
        meta = out["meta_info"]
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        if kind == "abort" and abort_as is not None:
            kind = abort_as
        elif kind not in ("stop", "length"):
            raise RuntimeError(f"SGLang sample {i}/{k % n} finished with {finish!r}")
        ids = [int(t) for t in out["output_ids"]]
        entries = meta.get("output_token_logprobs")
        if entries is None and not ids:  # aborted before its first token, or nothing left to sample
            entries = []
        if entries is None or len(entries) != len(ids):
            got = "none" if entries is None else len(entries)
            raise RuntimeError(
                f"SGLang sample {i}/{k % n}: {got} log-probs for {len(ids)} tokens (return_logprob=True?)"
            )
        logprobs = []
        for pos, (entry, tok) in enumerate(zip(entries, ids, strict=True)):
            lp, entry_tok = entry[0], entry[1]
            if entry_tok is not None and int(entry_tok) != tok:
                raise RuntimeError(
                    f"SGLang sample {i}/{k % n}: log-prob {pos} is for token {entry_tok}, output has {tok}"
                )
            if lp is None:
                raise RuntimeError(f"SGLang sample {i}/{k % n}: no log-prob for token {pos}")
            logprobs.append(float(lp))
        completions.append(Completion(i, ids, logprobs, kind))
    return completions


def params_key(prompts: Sequence[Sequence[int]], params: SamplingParams, indices: Sequence[tuple] = ()) -> tuple:
    """Equality key of one rank's generate call (`indices`: each request's (prompt_index, sample_index) in the request
    form), to generate identical calls of a TP group once."""
    return (
        tuple(tuple(int(t) for t in p) for p in prompts),
        tuple(tuple(i) for i in indices),
        tuple(sorted(_plain(dataclasses.asdict(params)).items())),
    )


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
