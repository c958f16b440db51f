"""The built-in engine over any transformers causal LM (`engine.native.impl=hf`), and the choice of implementation.

`native_impl` says which of the two native engines a model gets: the fused one (engines/fused/, our decoder for
llama/qwen2/qwen3) or this one, the fallback for every other architecture. This one is batched per call: the
requests of one `generate_requests` call are cut into chunks of ≤ max_batch_size rows, and one chunk runs as::

    prefill each run of equal adjacent prompts once  →  repeat its KV cache for the run's samples
    loop: sample (temperature/top-k/top-p, one counter uniform per row keyed per request) → drop finished rows
          from the batch and the cache → decode one step for the rows still running

It has no continuous batching: `AsyncEngine` serves it by collecting the requests that arrive together into one call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams
from hybridrl.engines.config import EngineConfig
from hybridrl.engines.native.base import NativeEngineBase, check_requests, prompt_runs
from hybridrl.engines.sampling import check_finite_logprobs, sample_tokens, stream_key
from hybridrl.errors import ConfigError

log = logging.getLogger(__name__)


def native_impl(cfg: EngineConfig, hf_config, tp_size: int = 1) -> str:
    """'fused' or 'hf' for `engine.native.impl` and this model (pure: no process group is made or needed).

    auto takes fused when it can (saying once why not when it cannot); impl=fused that cannot run raises
    ConfigError. With tp_size > 1 the hf path runs the whole model on every rank of the group (same prompts,
    same samples): correct, not sharded.
    """
    from hybridrl.engines.native.architectures import UnsupportedModel, check_supported

    if cfg.native.impl == "hf":
        return "hf"
    try:
        check_supported(hf_config)
    except UnsupportedModel as e:
        if cfg.native.impl == "fused":
            raise ConfigError(f"engine.native.impl=fused cannot run this model: {e}") from None
        log.info(
            "native engine: transformers path (fused decoder unsupported: %s)%s",
            e,
            f"; engine.tp_size={tp_size} replicates it on every rank" if tp_size > 1 else "",
        )
        return "hf"
    return "fused"


class HFEngine(NativeEngineBase):
    """Rollout engine over a Hugging Face causal LM with a DynamicCache, in this process."""

    weight_layout_style = "hf"

    def __init__(
        self, model: torch.nn.Module, eos_token_ids: Sequence[int], pad_token_id: int, max_batch_size: int = 256
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        # Shared (tied) parameters appear under every name they are known by, so a load by
        # either name lands in the one tensor.
        self._init_weights(
            {self._weight_name(n): p for n, p in model.named_parameters(remove_duplicate=False)},
            {self._weight_name(n): p for n, p in model.named_parameters()},
            next(model.parameters()).device,
        )
        self._generator = torch.Generator(device=self.device)

    def _weight_name(self, name: str) -> str:
        """The name `load_weights` knows a model parameter by (the resharder's): the model's own here."""
        return name

    # -- generation -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate_requests(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        self._check_awake("generate")
        check_requests(requests, self.takes_images)
        out: list[Completion] = []
        for chunk in self._chunks(requests):
            out += self._generate_chunk(chunk, params)
        return out

    def _chunks(self, requests: Sequence[GenerationRequest]) -> list[list[GenerationRequest]]:
        """Consecutive chunks of ≤ max_batch_size requests that keep each run of equal prompts whole when it fits
        (a longer run is cut into pieces of max_batch_size)."""
        chunks: list[list[GenerationRequest]] = [[]]
        for start, end in prompt_runs(requests):
            for piece in range(start, end, self.max_batch_size):
                run = list(requests[piece : min(end, piece + self.max_batch_size)])
                if len(chunks[-1]) + len(run) > self.max_batch_size:
                    chunks.append([])
                chunks[-1] += run
        return [c for c in chunks if c]

    def _generate_chunk(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        from transformers import DynamicCache

        dev = self.device
        runs = prompt_runs(requests)
        prompts = [requests[s].prompt_ids for s, _ in runs]
        width = max(len(p) for p in prompts)
        # Left padding lines every prompt's last token up in the last column.
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos, extra, next_pos = self._prefill_inputs([requests[s] for s, _ in runs], mask)
        cache = DynamicCache()
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **extra,
        ).logits[:, -1]
        counts = [e - s for s, e in runs]
        if any(c > 1 for c in counts):  # each run's samples share its prefill
            expand = torch.repeat_interleave(torch.arange(len(runs), device=dev), torch.tensor(counts, device=dev))
            cache.batch_select_indices(expand)
            logits, mask, next_pos = logits[expand], mask[expand], next_pos[expand]
        rows = len(requests)
        alive = torch.arange(rows, device=dev)  # row (in this chunk) of each batch row still running
        keys = None
        if params.seed is not None:
            keys = torch.tensor(
                [stream_key(params.seed, r.prompt_index, r.sample_index) for r in requests],
                dtype=torch.int64,
                device=dev,
            )
        tokens_out: list[list[int]] = [[] for _ in range(rows)]
        logps_out: list[list[float]] = [[] for _ in range(rows)]
        finish = ["length"] * rows
        stop_set = sorted(set(self.eos_token_ids) | set(params.stop_token_ids))  # may be empty: no stops
        stop_ids = torch.tensor(stop_set, dtype=torch.long, device=dev)

        for step in range(params.max_new_tokens):
            tok, lp = sample_tokens(
                logits,
                params.temperature,
                params.top_k,
                params.top_p,
                self._generator,
                keys=None if keys is None else keys[alive],
                step=step,
            )
            alive_l, tok_l, lp_l = alive.tolist(), tok.tolist(), lp.tolist()
            check_finite_logprobs(lp_l, f"native engine (transformers path), decode position {step}")
            for r, t, lp in zip(alive_l, tok_l, lp_l):
                tokens_out[r].append(t)
                logps_out[r].append(lp)
            done = torch.isin(tok, stop_ids)
            for r in alive[done].tolist():
                finish[r] = "stop"
            if step == params.max_new_tokens - 1:
                break
            keep = (~done).nonzero().squeeze(-1)
            if keep.numel() == 0:
                break
            if keep.numel() < alive.numel():
                # Finished rows leave the batch, and their KV rows leave the cache.
                cache.batch_select_indices(keep)
                alive, tok, mask, next_pos = alive[keep], tok[keep], mask[keep], next_pos[keep]
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
            logits = self.model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=self._step_positions(next_pos),
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            next_pos = next_pos + 1
        return [Completion(r.prompt_index, tokens_out[i], logps_out[i], finish[i]) for i, r in enumerate(requests)]

    def _prefill_inputs(
        self, prompts: Sequence[GenerationRequest], mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """(position ids, more model inputs, each row's next position) of the prefill of `prompts`, left-padded as
        `mask` [rows, width] says: positions count the real tokens from 0."""
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return pos, {}, pos[:, -1] + 1

    def _step_positions(self, next_pos: torch.Tensor) -> torch.Tensor:
        """Position ids of one decode step from each row's next position [rows]."""
        return next_pos[:, None]

    def shutdown(self) -> None:
        super().shutdown()
        del self.model
