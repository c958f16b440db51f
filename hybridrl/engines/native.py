"""The built-in rollout engine, two implementations behind one class:

- fused (`NativeEngine.fused`, engines/fused/): our decoder for llama/qwen2/qwen3 with fused, TP-sharded
  weights (the resharder's "fused" layout), a preallocated KV cache and CUDA-graphed decode steps;
- hf (`NativeEngine(model, ...)`, this file): any transformers causal LM with a DynamicCache, the fallback.

`native_impl` picks one for `engine.impl`. The hf path's generation for one chunk of prompts::

    prefill each distinct prompt once  →  repeat its KV cache n times
    loop: sample (temperature/top-k/top-p) → drop finished rows from the batch and the cache
          → decode one step for the rows still running

It holds its own copy of the weights and sees new ones only through `load_weights`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch

from hybridrl.engines.base import WAKE_TAGS, Completion, RolloutEngine, SamplingParams
from hybridrl.engines.config import EngineConfig
from hybridrl.engines.weight_parking import WeightParking
from hybridrl.engines.sampling import sample_tokens, stream_key
from hybridrl.errors import ConfigError, HybridRLError

log = logging.getLogger(__name__)


def native_impl(cfg: EngineConfig, hf_config, tp_size: int = 1) -> str:
    """'fused' or 'hf' for `engine.impl` and this model: auto takes fused when it can (saying why not, once, when
    it cannot); impl=fused that cannot run raises ConfigError."""
    if cfg.impl == "hf":
        return "hf"
    from hybridrl.engines.fused.rope import UnsupportedModel, check_supported

    try:
        check_supported(hf_config)
    except UnsupportedModel as e:
        if cfg.impl == "fused":
            raise ConfigError(f"engine.impl=fused cannot run this model: {e}") from None
        log.info("native engine: transformers path (fused decoder unsupported: %s)", e)
        return "hf"
    return "fused"


class NativeEngine(RolloutEngine):
    """Rollout engine in this process: over a Hugging Face causal LM (this constructor), or over our fused
    decoder (`NativeEngine.fused`, a `FusedEngine`)."""

    weight_layout_style = "hf"

    def __init__(self, model: torch.nn.Module, eos_token_ids: Sequence[int], pad_token_id: int, max_batch_size: int = 256) -> None:
        self.model = model.eval().requires_grad_(False)
        self.device = next(model.parameters()).device
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        # Shared (tied) parameters appear under every name they are known by, so a load by
        # either name lands in the one tensor.
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._unique = dict(model.named_parameters())
        self._parking = WeightParking(self._unique, self.device)
        self._asleep: set[str] = set()
        self._generator = torch.Generator(device=self.device)

    @classmethod
    def fused(cls, hf_config, eos_token_ids: Sequence[int], pad_token_id: int | None, *,
              device: torch.device | str, dtype: torch.dtype, cfg: EngineConfig | None = None,
              tp_group=None, seed: int = 0) -> NativeEngine:
        """The native engine on our fused decoder (llama/qwen2/qwen3), TP-sharded over `tp_group`. Its weights
        start uninitialized: fill them with `load_weights` (fused names, e.g. by the resharder) or `load_from`."""
        from hybridrl.engines.fused.engine import FusedEngine

        return FusedEngine(hf_config, eos_token_ids, pad_token_id, device=device, dtype=dtype, cfg=cfg,
                           tp_group=tp_group, seed=seed)

    # -- generation -----------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        if self._asleep:
            raise HybridRLError(f"native engine: generate called while {sorted(self._asleep)} are asleep; call wake_up first")
        per_chunk = max(1, self.max_batch_size // params.n)
        out: list[Completion] = []
        for start in range(0, len(prompts), per_chunk):
            out += self._generate_chunk(prompts[start : start + per_chunk], params, start)
        return out

    def _generate_chunk(self, prompts: Sequence[Sequence[int]], params: SamplingParams, offset: int) -> list[Completion]:
        from transformers import DynamicCache

        n, dev = params.n, self.device
        lengths = [len(p) for p in prompts]
        if min(lengths) == 0:
            raise HybridRLError("native engine: an empty prompt cannot be generated from")
        width = max(lengths)
        # Left padding lines every prompt's last token up in the last column.
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1
        ).logits[:, -1]
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits, mask = logits.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
            pos = pos.repeat_interleave(n, 0)
        next_pos = pos[:, -1] + 1
        rows = len(prompts) * n
        alive = torch.arange(rows, device=dev)  # row (in this chunk) of each batch row still running
        keys = None
        if params.seed is not None:
            first = params.prompt_offset + offset
            keys = torch.tensor(
                [stream_key(params.seed, first + r // n, r % n) for r in range(rows)], dtype=torch.int64, device=dev
            )
        tokens_out: list[list[int]] = [[] for _ in range(rows)]
        logps_out: list[list[float]] = [[] for _ in range(rows)]
        finish = ["length"] * rows
        stop_set = sorted(set(self.eos_token_ids) | set(params.stop_token_ids))  # may be empty: no stops
        stop_ids = torch.tensor(stop_set, dtype=torch.long, device=dev)

        for step in range(params.max_new_tokens):
            tok, lp = sample_tokens(
                logits, params.temperature, params.top_k, params.top_p, self._generator,
                keys=None if keys is None else keys[alive], step=step,
            )
            alive_l, tok_l, lp_l = alive.tolist(), tok.tolist(), lp.tolist()
            for r, t, l in zip(alive_l, tok_l, lp_l):
                tokens_out[r].append(t)
                logps_out[r].append(l)
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
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            next_pos = next_pos + 1
        return [
            Completion(offset + r // n, tokens_out[r], logps_out[r], finish[r]) for r in range(rows)
        ]

    # -- memory lifecycle ----------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache; level 1 parks weights in pinned host memory (GPU; on CPU they stay where they
        are), level 2 drops them (the next reshard rewrites every one)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._free_cache()
        if self._parking.park(level):
            self._asleep.add("weights")
        if self.device.type != "cpu":
            torch.cuda.empty_cache()
        self._asleep.add("kv_cache")

    def wake_up(self, tags: Sequence[str] = WAKE_TAGS) -> None:
        """Reallocate weights (restored from host after level 1, stale after level 2 until load_weights)
        and/or the KV cache."""
        unknown = set(tags) - set(WAKE_TAGS)
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; valid: {WAKE_TAGS}")
        if "weights" in tags and "weights" in self._asleep:
            self._parking.restore()
            self._asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self._asleep:
            self._asleep.discard("kv_cache")
            self._allocate_cache()

    def _free_cache(self) -> None:
        """Release the KV cache (the HF path's cache lives only inside `generate`: nothing to do)."""

    def _allocate_cache(self) -> None:
        """Reallocate the KV cache after a sleep (the HF path allocates per `generate`: nothing to do)."""

    # -- weights --------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if "weights" in self._asleep:
            raise HybridRLError("native engine: load_weights while weights are asleep; wake_up(['weights']) first")
        for name, tensor in named_tensors:
            param = self._params.get(name)
            if param is None:
                raise HybridRLError(f"native engine: no parameter named {name!r} in the rollout model")
            if param.shape != tensor.shape:
                raise HybridRLError(f"native engine: {name} has shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
            param.copy_(tensor, non_blocking=True)

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self._unique.items()

    def memory_stats(self) -> dict[str, float]:
        weights = sum(p.numel() * p.element_size() for p in self._unique.values())
        return {"engine_weights_gb": weights / 2**30}

    def shutdown(self) -> None:
        self._params.clear()
        self._unique.clear()
        self._parking.clear()
        del self.model
