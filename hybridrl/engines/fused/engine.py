"""The native engine on our fused decoder: preallocated KV cache, batched prefill, (graphed) decode steps.

Generation for one chunk of prompts (≤ max_batch_size rows)::

    prefill prompts in groups of ≤ engine.prefill_tokens (right-padded), each prompt's K/V into its n slots
    loop: sample (sample_tokens, counter keys) → record token/log-prob on the device
          → every few steps: read which rows finished; compact the survivors to the front slots
          → decode one step for slots [0, B) (a CUDA graph per (B, length) bucket on GPU)

Host syncs happen only at those checks and at the end, so the GPU never waits for Python between steps.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from hybridrl.engines.base import Completion, SamplingParams
from hybridrl.engines.config import EngineConfig
from hybridrl.engines.fused.graphs import LENGTH_BUCKET, DecodeRunner
from hybridrl.engines.fused.groups import TensorParallel
from hybridrl.engines.fused.kv_cache import KVCache
from hybridrl.engines.fused.model import FusedDecoder
from hybridrl.engines.native import NativeEngine
from hybridrl.engines.sampling import sample_tokens, stream_key
from hybridrl.engines.weight_parking import WeightParking
from hybridrl.errors import HybridRLError

log = logging.getLogger(__name__)


class FusedEngine(NativeEngine):
    """`NativeEngine` over `FusedDecoder`: fused, TP-sharded weights (`weight_layout_style = "fused"`)."""

    weight_layout_style = "fused"
    starts_empty = True

    def __init__(self, hf_config, eos_token_ids: Sequence[int], pad_token_id: int | None, *,
                 device: torch.device | str, dtype: torch.dtype, cfg: EngineConfig | None = None,
                 tp_group=None, seed: int = 0) -> None:
        """Weights start uninitialized: fill them with `load_weights` (the resharder) or `load_from`."""
        self.cfg = cfg or EngineConfig()
        self.device = torch.device(device)
        self.tp = TensorParallel.of(tp_group)
        self.model = FusedDecoder(hf_config, self.tp, dtype, self.device)
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id if pad_token_id is not None else 0
        self.max_batch_size = self.cfg.max_batch_size
        self.vocab = hf_config.vocab_size
        self._params = dict(self.model.named_parameters())
        self._unique = self._params  # no tied duplicates: a tied lm_head is the embedding itself
        self._parking = WeightParking(self._params, self.device)
        self._asleep: set[str] = set()
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self.cache: KVCache | None = None
        self._cache_dims: tuple[int, int] | None = None  # (slots, max_len) to restore at wake-up
        self.runner = DecodeRunner(self.model, self.cfg.cuda_graphs)
        self._check_every = 1 if self.device.type == "cpu" else 4  # steps between reads of finished rows

    @torch.no_grad()
    def load_from(self, hf_model: torch.nn.Module) -> None:
        """Fill the weights from an HF causal LM of the same config (cut for this TP rank by the resharder)."""
        from hybridrl.reshard import ReshardConfig, Resharder

        Resharder(ReshardConfig(), self, hf_model.config, tp_rank=self.tp.rank, tp_size=self.tp.size).sync(hf_model)

    # -- KV cache -------------------------------------------------------------------------------------
    def _allocate(self, slots: int, max_len: int) -> None:
        self._free_cache()
        m = self.model
        self.cache = KVCache(m.shape.num_layers, slots, max_len, m.kv_heads, m.head_dim, m.dtype, self.device)
        self._cache_dims = (slots, max_len)
        m.ensure_positions(max_len)
        self.runner.bind(self.cache)

    def _free_cache(self) -> None:
        # Blocks go back to the caching allocator; `sleep` hands them to the device. Emptying the cache here
        # too made every wake-up give the trainer's just-offloaded memory to the driver and take it back.
        self.runner.release()  # graphs first: they hold the cache's addresses
        self.cache = None

    def _ensure_cache(self, rows: int, length: int) -> KVCache:
        fixed = self.cfg.max_model_len
        if fixed and length > fixed:
            raise HybridRLError(f"native engine: a prompt + max_new_tokens needs {length} tokens per sequence, "
                                f"more than engine.max_model_len={fixed}")
        if self.cache is None or not self.cache.fits(rows, length):
            old = self._cache_dims or (0, 0)
            slots = max(rows, self.max_batch_size, old[0])
            max_len = fixed or -(-max(length, old[1]) // LENGTH_BUCKET) * LENGTH_BUCKET
            if self.cache is not None and self.device.type == "cuda":
                self._free_cache()
                torch.cuda.empty_cache()  # the old cache's blocks are too small for the new one: release them
            self._allocate(slots, max_len)
        return self.cache

    # -- generation -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def last_logits(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Each prompt's next-token logits [len(prompts), vocab] in float32 (a prefill; for parity checks)."""
        if self._asleep:
            raise HybridRLError(f"native engine: last_logits while {sorted(self._asleep)} are asleep")
        cache = self._ensure_cache(len(prompts), max(len(p) for p in prompts))
        return self._prefill(prompts, 1, cache)[:, : self.vocab].float()

    def _prefill(self, prompts: Sequence[Sequence[int]], n: int, cache: KVCache) -> torch.Tensor:
        """Prefill in groups of ≤ engine.prefill_tokens padded tokens; logits [len(prompts), padded vocab]."""
        out, start = [], 0
        while start < len(prompts):
            end, width = start + 1, len(prompts[start])
            while end < len(prompts) and (end - start + 1) * max(width, len(prompts[end])) <= self.cfg.prefill_tokens:
                width = max(width, len(prompts[end]))
                end += 1
            ids = torch.full((end - start, width), self.pad_token_id, dtype=torch.long)
            for i, p in enumerate(prompts[start:end]):
                ids[i, : len(p)] = torch.as_tensor(p, dtype=torch.long)
            lengths = torch.tensor([len(p) for p in prompts[start:end]], device=self.device)
            out.append(self.model.prefill(ids.to(self.device), lengths, cache, start * n, n))
            start = end
        return torch.cat(out) if len(out) > 1 else out[0]

    def _generate_chunk(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                        offset: int) -> list[Completion]:
        n, dev, max_new = params.n, self.device, params.max_new_tokens
        lengths = [len(p) for p in prompts]
        if min(lengths) == 0:
            raise HybridRLError("native engine: an empty prompt cannot be generated from")
        rows, longest = len(prompts) * n, max(lengths)
        cache = self._ensure_cache(rows, longest + max_new)
        logits = self._prefill(prompts, n, cache)
        if n > 1:
            logits = logits.repeat_interleave(n, 0)
        run = self.runner
        run.pos[:rows] = torch.tensor(lengths, device=dev).repeat_interleave(n)
        keys = None
        if params.seed is not None:
            first = params.prompt_offset + offset
            keys = torch.tensor([stream_key(params.seed, first + r // n, r % n) for r in range(rows)],
                                dtype=torch.int64, device=dev)
        stop_set = sorted(set(self.eos_token_ids) | set(params.stop_token_ids))  # may be empty: no stops
        stop_ids = torch.tensor(stop_set, dtype=torch.long, device=dev)
        out_tok = torch.zeros(rows, max_new, dtype=torch.long, device=dev)
        out_lp = torch.zeros(rows, max_new, dtype=torch.float32, device=dev)
        done_at = torch.full((rows,), max_new, dtype=torch.long, device=dev)  # step of the stop token
        row_id = torch.arange(rows, device=dev)  # the chunk row each slot [0, batch) generates for
        batch = rows
        for step in range(max_new):
            tok, lp = sample_tokens(logits[:, : self.vocab], params.temperature, params.top_k, params.top_p,
                                    self._generator, keys=keys, step=step, kernel=self.cfg.sampler_kernel)
            out_tok[row_id, step] = tok
            out_lp[row_id, step] = lp
            prev = done_at[row_id]
            done_at[row_id] = torch.where(torch.isin(tok, stop_ids) & (prev == max_new), step, prev)
            if step == max_new - 1:
                break
            if (step + 1) % self._check_every == 0:
                running = done_at[row_id] == max_new
                alive = running.nonzero().squeeze(-1)  # the host sync
                if alive.numel() == 0:
                    break
                target = run.batch_target(alive.numel())
                if target < batch:
                    # Survivors (plus finished fillers up to the bucket) move to slots [0, target).
                    keep = torch.cat([alive, (~running).nonzero().squeeze(-1)[: target - alive.numel()]])
                    cache.compact(keep, longest + step)
                    run.pos[:target] = run.pos[:batch][keep]
                    tok, row_id = tok[keep], row_id[keep]
                    keys = None if keys is None else keys[keep]
                    batch = target
            run.tokens[:batch].copy_(tok)
            logits = run.step(batch, run.length_for(longest + step + 1))
            run.pos[:batch] += 1
        toks, lps, ends = out_tok.tolist(), out_lp.tolist(), done_at.tolist()
        out = []
        for r in range(rows):
            stop = ends[r] < max_new
            count = ends[r] + 1 if stop else max_new
            out.append(Completion(offset + r // n, toks[r][:count], lps[r][:count], "stop" if stop else "length"))
        return out

    # -- memory lifecycle -----------------------------------------------------------------------------
    def _allocate_cache(self) -> None:
        """The KV cache at engine.max_model_len, or at its last size; else it is sized at the first generate."""
        if self.cfg.max_model_len:
            self._allocate(max(self.max_batch_size, (self._cache_dims or (0, 0))[0]), self.cfg.max_model_len)
        elif self._cache_dims:
            self._allocate(*self._cache_dims)

    def memory_stats(self) -> dict[str, float]:
        weights = sum(p.numel() * p.element_size() for p in self._params.values())
        kv = self.cache.nbytes() if self.cache is not None else 0
        return {"engine_weights_gb": weights / 2**30, "engine_kv_cache_gb": kv / 2**30}

    def shutdown(self) -> None:
        self._free_cache()
        self._params.clear()
        self._parking.clear()
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
