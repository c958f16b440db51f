"""The native engine on our fused decoder: paged KV cache, continuous batching, CUDA-graphed decode steps.

    engine = FusedEngine(hf_config, eos_ids, pad_id, device=..., dtype=..., options=cfg.native, tp_group=group)
    <caller fills the weights: load_weights with fused names, e.g. the resharder>
    engine.generate(prompts, params)                    # single-turn: every request at once, run to the end
    handle = engine.submit(request, params)             # continuous: requests join while it runs ...
    for handle, completion in engine.step(): ...        # ... one token per running sequence per step

`generate` and `generate_requests` are `submit` for every request, then `step` until all are done (see
`native/scheduler.py` for the loop; `native/async_engine.py` for many coroutines sharing one engine). The engine
neither makes process groups nor imports the resharder: its TP group and its weights come from the caller. Its
Triton kernels launch with programmatic dependent launch per `engine.native.pdl` (`kernels/pdl.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams
from hybridrl.engines.config import NativeOptions
from hybridrl.engines.lockstep import SIZE, Lockstep, leading
from hybridrl.engines.native.async_engine import AsyncEngine, replay
from hybridrl.engines.native.base import NativeEngineBase, check_requests
from hybridrl.engines.native.fixed_memory import (
    FixedMemory,
    fixed_bytes,
    fixed_memory,
    peak_mapped_bytes,
    reset_peak_mapped,
)
from hybridrl.engines.native.fixed_memory import mapped_bytes as device_mapped_bytes
from hybridrl.engines.native.frozen_heap import frozen_heap
from hybridrl.engines.native.kernels import pdl
from hybridrl.engines.native.kv_cache import BlockAllocator, PagedKVCache, blocks_for
from hybridrl.engines.native.model import FusedDecoder
from hybridrl.engines.native.partial import PartialGeneration
from hybridrl.engines.native.prompts import PromptPath
from hybridrl.engines.native.runner import DecodeRunner
from hybridrl.engines.native.scheduler import PromptGroup, Scheduler
from hybridrl.engines.native.tensor_parallel import TensorParallel
from hybridrl.errors import HybridRLError
from hybridrl.models.vision import MropeIndex, build_vision_tower, is_vision_language, text_config

log = logging.getLogger(__name__)


class FusedEngine(PartialGeneration, PromptPath, NativeEngineBase):
    """The built-in engine over `FusedDecoder`: fused, TP-sharded weights (`weight_layout_style = "fused"`)."""

    weight_layout_style = "fused"
    starts_empty = True
    gates_memory = True

    def __init__(
        self,
        hf_config,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        options: NativeOptions | None = None,
        tp_group: torch.distributed.ProcessGroup | None = None,
        seed: int = 0,
        tower_trains: bool = False,
    ) -> None:
        """Weights start uninitialized: the caller fills them with `load_weights` (fused names; a vision-language
        model's tower as ``visual.*``). `tp_group` is this rank's engine TP group (None: one rank). `tower_trains`: the
        resharder delivers the vision tower with every sync; else its weights keep their values across every
        sleep (the first fill delivers them)."""
        self.options = options or NativeOptions()
        device = torch.device(device)
        self.tp = TensorParallel.of(tp_group)
        self.model = FusedDecoder(hf_config, self.tp, dtype, device, kernels=self.options.kernels)
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id if pad_token_id is not None else 0
        self.vocab = text_config(hf_config).vocab_size
        self.block_size = self.options.kv_block_size
        params = dict(self.model.named_parameters())  # no tied duplicates: a tied lm_head is the embedding itself
        # A vision-language model: its vision tower, whole on every rank, and its multimodal positions.
        self.vision: torch.nn.Module | None = None
        self.mrope: MropeIndex | None = None
        if is_vision_language(hf_config):
            self.vision, skeleton = build_vision_tower(hf_config, dtype, device)
            self.mrope = MropeIndex(skeleton)
            params.update({f"visual.{n}": p for n, p in self.vision.named_parameters()})
            self.takes_images = True
        self._init_weights(params, params, device, self._fixed_weights(params, device))
        if self.vision is not None and not tower_trains:
            self.preserve_weights(n for n in params if n.startswith("visual."))
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._lockstep: Lockstep | None = None  # the TP group's schedule, inside `lead` or `follow`
        self.cache: PagedKVCache | None = None
        self._pool_blocks = 0  # the size to restore at wake-up (0: sized at the first generate)
        self.runner = DecodeRunner(
            self.model,
            self.options.max_batch_size,
            self.options.cuda_graphs,
            self.options.prefill_tokens,
            self.options.join_step_tokens,
            self.options.shared_prefix_tokens,
        )
        self.scheduler = Scheduler(
            self,
            self.options.max_batch_size,
            self.eos_token_ids,
            self.options.max_model_len,
            self.options.sampler_kernel,
            self.options.prefix_cache,
            self.options.join_wait_steps,
            self.options.join_step_tokens,
        )

    # -- requests ---------------------------------------------------------------------------------------
    @property
    def image_token_id(self) -> int | None:
        """The image placeholder token of a vision-language model (`scheduler.Backend`), else None."""
        return self.mrope.image_token_id if self.mrope is not None else None

    @property
    def has_work(self) -> bool:
        """Whether a submitted request has not come back from `step` yet."""
        return self.scheduler.has_work

    def submit(self, request: GenerationRequest, params: SamplingParams) -> int:
        """Queue one request; its completion comes back from `step` under the returned handle."""
        self._check_awake("submit")
        if self.tp.size > 1 and self.scheduler.has_work and self._lockstep is None:
            # Every rank of a TP group must make the same batches: requests joining a running batch could arrive at
            # different steps on different ranks, unless the group keeps the leader's schedule (`lead`, `follow`).
            raise HybridRLError(
                "native engine: requests cannot join a running batch with engine.tp_size > 1 outside lead/follow; "
                "submit them together (generate_requests)"
            )
        return self.scheduler.submit(request, params)

    @torch.inference_mode()
    def step(self) -> list[tuple[int, Completion]]:
        """One scheduler step (see native/scheduler.py): the completions that finished, with their handles."""
        self._check_awake("step")
        with self._launches():
            return self.scheduler.step()

    @torch.inference_mode()
    def generate_requests(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        self._check_awake("generate")
        check_requests(requests, self.takes_images)
        if self.scheduler.has_work:
            raise HybridRLError(
                "native engine: generate_requests while other requests run; use submit/step (or AsyncEngine) for both"
            )
        handles = self.scheduler.submit_all(requests, params)
        done: dict[int, Completion] = {}
        try:
            if requests:
                self.size_for(max(len(r.prompt_ids) for r in requests) + params.max_new_tokens - 1)
            with frozen_heap(), self._launches():
                while self.scheduler.has_work:
                    done.update(self.scheduler.step())
        except BaseException:
            self.scheduler.abort()  # nothing half-done is left for the next call
            raise
        return [done[h] for h in handles]

    def async_engine(self, longest: int | None = None) -> AsyncEngine | None:
        """Requests one at a time, each joining the running batch (`AsyncEngine`: agent turns); the KV cache, where it
        is sized by demand, first sized for sequences of `longest` tokens, as `generate_requests` sizes it for its call
        (a pool grows only while no sequence holds blocks). On a GPU its driver steps the engine in a thread of its own.
        With engine.tp_size > 1 only inside `lead`, whose schedule the group's other ranks replay (`follow`); else
        None."""
        if self.tp.size > 1 and self._lockstep is None:
            return None
        if longest and not self.scheduler.has_work:
            self._check_awake("async_engine")
            self.size_for(longest)
            if self._lockstep is not None:
                self._lockstep.send(SIZE, longest)
        return AsyncEngine(self, self._lockstep, threaded=self.device.type == "cuda")

    def size_for(self, longest: int) -> None:
        """The KV cache (where it is sized by demand) and the block tables sized for sequences of `longest` tokens
        before a call's first step: neither grows inside the call, so no graph the call captures is dropped before it
        ends (and captured again by the next rollout)."""
        blocks = blocks_for(longest, self.block_size)
        self.kv_allocator(0, blocks)
        self.reserve_width(blocks)

    @contextmanager
    def lead(self, group: torch.distributed.ProcessGroup) -> Iterator[None]:
        """The TP leader's agent rollout at engine.tp_size > 1 (`engines/lockstep.py`; `group`: the TP group on a host
        backend): inside, `async_engine`'s stream sends each step's new requests to the other ranks, which `follow`;
        leaving the block ends their phase, or fails it with the block's error."""
        try:
            with leading(group) as self._lockstep:
                yield
        finally:
            self._lockstep = None

    def follow(self, group: torch.distributed.ProcessGroup) -> None:
        """Another rank's part of the leader's agent rollout (`lead`): the leader's engine schedule replayed here until
        its phase ends. The completions are the leader's; this rank runs no agent loop and no tool."""
        self._check_awake("follow")
        self._lockstep = Lockstep(group)
        try:
            replay(self, self._lockstep)
        except BaseException:
            self.scheduler.abort()  # nothing half-done is left for the next phase
            raise
        finally:
            self._lockstep = None

    @torch.inference_mode()
    def last_logits(self, prompts: Sequence[Sequence[int]], cached: Sequence[int] | None = None) -> torch.Tensor:
        """Each prompt's next-token logits [len(prompts), vocab] in float32 (a prefill; for parity checks). With
        `cached`, prompt i's first cached[i] tokens are prefilled first and the rest continues them, as an agent's
        next turn does."""
        self._check_awake("last_logits")
        per_seq = max(blocks_for(len(p), self.block_size) for p in prompts)
        alloc = self.kv_allocator(per_seq * len(prompts), per_seq)
        self.reserve_width(per_seq)  # RoPE tables for the longest prompt
        groups = [PromptGroup(list(p), alloc.allocate(blocks_for(len(p), self.block_size)), []) for p in prompts]
        try:
            with self._launches():
                if cached is not None and any(cached):
                    self._prefill_logits(
                        [PromptGroup(list(p[:c]), g.shared, []) for p, c, g in zip(prompts, cached, groups) if c]
                    )
                    for g, c in zip(groups, cached):
                        g.cached = c
                return self._prefill_logits(groups)[:, : self.vocab].float()
        finally:
            for g in groups:
                alloc.release(g.shared)

    def _launches(self):
        """The block inside which this engine's kernels launch as `engine.native.pdl` says."""
        return pdl.launches(self.options.pdl == "on")

    # -- the scheduler's backend --------------------------------------------------------------------------
    def kv_allocator(self, need: int, per_seq: int) -> BlockAllocator:
        cache, o = self.cache, self.options
        if cache is not None and cache.allocator.held:
            return cache.allocator  # blocks are held: the pool stays as it is
        if o.kv_blocks or o.kv_memory_fraction:
            blocks = cache.num_blocks if cache is not None else (o.kv_blocks or self._fraction_blocks())
            if need > blocks - 1:
                raise HybridRLError(
                    f"native engine: a sequence needs {need} KV blocks of {self.block_size} tokens, "
                    f"the cache holds {blocks - 1}; raise engine.native.kv_blocks (or "
                    "engine.native.kv_memory_fraction)"
                )
        else:  # by demand, never shrinking: max_batch_size sequences of the longest request seen
            blocks = max(1 + max(need, o.max_batch_size * per_seq), self._pool_blocks)
        if cache is None:
            self._allocate(blocks)
        elif blocks > cache.num_blocks:  # no block is held here: only the prefix table's contents move along
            self._make_room((blocks - cache.num_blocks) * self._block_bytes())
            width = self.runner.width
            self.runner.release()
            cache.grow(blocks, self._kv_memory(blocks))
            self._pool_blocks = blocks
            self.runner.bind(cache, width)
        return self.cache.allocator

    def reserve_width(self, blocks: int) -> None:
        if self.runner.width < blocks:
            width = (
                blocks_for(self.options.max_model_len, self.block_size)
                if self.options.max_model_len
                else 1 << (blocks - 1).bit_length()
            )  # powers of two: few regrowths, few graph recaptures
            self.runner.grow_table(max(width, blocks))
        if self.model.ensure_positions(self.runner.width * self.block_size):
            self.runner.drop_graphs()

    def load_weights(self, named_tensors) -> None:
        super().load_weights(named_tensors)
        if self.cache is not None:
            self.cache.allocator.forget_prefixes()  # K/V computed with the old weights

    # -- fixed addresses ----------------------------------------------------------------------------------
    def _fixed_weights(self, params: dict[str, torch.nn.Parameter], device: torch.device) -> FixedMemory | None:
        """With engine.native.fixed_addresses (GPU): every parameter becomes a view of one `FixedMemory`, which a
        sleep releases and a wake-up maps again at the same addresses; else None."""
        if not self.options.fixed_addresses:
            return None
        memory = fixed_memory(fixed_bytes([(tuple(p.shape), p.dtype) for p in params.values()]), device)
        if memory is not None:
            for p in params.values():  # not loaded yet (the caller fills them): nothing to copy over
                p.data = memory.view(tuple(p.shape), p.dtype)
        return memory

    def _kv_memory(self, blocks: int) -> FixedMemory | None:
        """A `FixedMemory` for a pool of `blocks` blocks, with engine.native.fixed_addresses (GPU); else None."""
        if not self.options.fixed_addresses:
            return None
        m = self.model
        return fixed_memory(
            PagedKVCache.fixed_size(m.shape.num_layers, blocks, self.block_size, m.kv_heads, m.head_dim, m.dtype),
            self.device,
        )

    # -- KV cache -----------------------------------------------------------------------------------------
    def _prefill_workspace_bytes(self) -> int:
        """About the most a prefill of engine.native.prefill_tokens tokens holds at once beyond the cache: the
        residual and normed hidden states, q/k/v, attention output, and the gate/up and SiLU·up activations of one
        layer (this rank's share)."""
        m = self.model
        per_token = 4 * m.shape.hidden + 3 * m.shape.intermediate // self.tp.size
        return self.options.prefill_tokens * per_token * m.dtype.itemsize

    def _block_bytes(self) -> int:
        m = self.model
        return PagedKVCache.bytes_per_block(m.shape.num_layers, self.block_size, m.kv_heads, m.head_dim, m.dtype)

    def _fraction_blocks(self) -> int:
        if self.device.type != "cuda":
            return 0
        self._make_room(None)  # a fraction of what is free: everything the trainer may free, first
        per = self._block_bytes()
        held = self.cache.nbytes() if self.cache is not None else 0
        return int((torch.cuda.mem_get_info(self.device)[0] + held) * self.options.kv_memory_fraction // per)

    def _allocate(self, blocks: int) -> None:
        width = (
            self.runner.width
            if self.runner.table is not None
            else max(1, blocks_for(self.options.max_model_len, self.block_size))
        )
        had_pool = self.cache is not None
        self._drop_pool()  # only ever with no block held: waiting requests stay queued
        self._make_room(blocks * self._block_bytes() + self._prefill_workspace_bytes())
        if had_pool and self.device.type == "cuda":
            # An old pool's memory is too small for the new one: let it go. Not at a wake-up (no pool): that would
            # hand the trainer's cached memory to the driver only to take it back, and its cudaFree waits for every
            # copy in flight, a lazy offload's too.
            torch.cuda.empty_cache()
        m = self.model
        self.cache = PagedKVCache(
            m.shape.num_layers,
            blocks,
            self.block_size,
            m.kv_heads,
            m.head_dim,
            m.dtype,
            self.device,
            self._kv_memory(blocks),
        )
        self._pool_blocks = blocks
        self.runner.bind(self.cache, width)
        self.reserve_width(width)

    def _free_cache(self) -> None:
        # Blocks go back to the caching allocator; `sleep` hands them to the device. Emptying the cache here
        # too made every wake-up give the trainer's just-offloaded memory to the driver and take it back.
        if self.scheduler.has_work:
            log.warning(
                "native engine: the KV cache is freed with %d requests unfinished; they are dropped",
                len(self.scheduler.waiting) + len(self.scheduler.rows),
            )
        self.scheduler.abort()
        if self.cache is not None and self.cache.release():
            self.runner.end_rollout()  # its addresses stay reserved: the runner keeps its graphs for the next wake-up
            return
        self._drop_pool()

    def _drop_pool(self) -> None:
        self.runner.release()  # graphs first: they hold the cache's addresses
        self.cache = None

    def _allocate_cache(self) -> None:
        """The KV cache at its configured size, or at its last size; else it is sized at the first generate. A pool at
        fixed addresses comes back at its size and addresses (its graphs with it)."""
        if self.cache is not None and not self.cache.resident:
            self._make_room(self.cache.nbytes() + self._prefill_workspace_bytes())
            self.cache.restore()
            return
        o = self.options
        if o.kv_blocks or o.kv_memory_fraction:
            self.kv_allocator(0, 1)
        elif o.max_model_len:
            self.kv_allocator(0, blocks_for(o.max_model_len, self.block_size))
        elif self._pool_blocks:
            self._allocate(self._pool_blocks)

    def memory_stats(self) -> dict[str, float]:
        kv = self.cache.nbytes() if self.cache is not None and self.cache.resident else 0
        return {**super().memory_stats(), "engine_kv_cache_gb": kv / 2**30}

    def take_stats(self) -> dict[str, float]:
        """`engine/graph_captures`, `engine/graph_capture_s` (host seconds) and `engine/eager_steps` (decode steps run
        without a graph while graphs are on) since the last call, and the decode steps' occupancy
        (`Scheduler.take_occupancy`)."""
        n, seconds = self.runner.take_capture_stats()
        stats = {
            "engine/graph_captures": float(n),
            "engine/graph_capture_s": seconds,
            "engine/eager_steps": float(self.runner.cuda_graphs.take_eager_steps()),
        }
        return {**stats, **self.scheduler.take_occupancy()}  # perf/engine_rows_mean, perf/engine_rows_idle

    def mapped_bytes(self) -> int:
        """The fixed-address weights and KV cache mapped on this device now (`fixed_memory`; 0 off CUDA)."""
        return device_mapped_bytes(self.device) if self.device.type == "cuda" else 0

    def take_peak_mapped_bytes(self) -> int:
        if self.device.type != "cuda":
            return 0
        peak = peak_mapped_bytes(self.device)
        reset_peak_mapped(self.device)
        return peak

    def shutdown(self) -> None:
        super().shutdown()
        self._drop_pool()  # a pool at fixed addresses survives `_free_cache`, and the runner's graphs with it
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
