"""What the two built-in engines share: the request form of generation, sleep/wake with the weights offloaded to host
memory, and loading weights by name.

    HFEngine (native/hf.py)             any transformers causal LM; batched per call
    FusedEngine (native/engine.py)      our decoder on the fused TP layout; paged KV cache, continuous batching

Both generate through `generate_requests`; `generate(prompts, params)` is that over
`GenerationRequest(prompts[i], params.prompt_offset + i, j)` for every prompt i and sample j < n, so the two forms
draw the same tokens for the same seed. Which class runs is decided by `build_engine` (with `native_impl`).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Sequence

import torch

from hybridrl.data.images import ImageInputs, image_key
from hybridrl.engines.base import WAKE_TAGS, Completion, GenerationRequest, MemoryGate, RolloutEngine, SamplingParams
from hybridrl.engines.native.fixed_memory import FixedMemory
from hybridrl.engines.native.weight_offload import WeightOffloader
from hybridrl.errors import HybridRLError


def requests_of(
    prompts: Sequence[Sequence[int]], params: SamplingParams, images: Sequence[ImageInputs | None] | None = None
) -> list[GenerationRequest]:
    """The requests `generate(prompts, params, images)` stands for: params.n samples of each prompt, prompt-major."""
    images = images if images is not None else [None] * len(prompts)
    return [
        GenerationRequest(list(p), params.prompt_offset + i, j, images=images[i])
        for i, p in enumerate(prompts)
        for j in range(params.n)
    ]


def same_prompt(a: GenerationRequest, b: GenerationRequest) -> bool:
    """Whether two requests continue the same context: equal tokens and, for images, equal pictures (equal tokens
    with other pictures are another prompt; pictures of unknown content are equal only to themselves)."""
    if a.prompt_ids != b.prompt_ids:
        return False
    if a.images is b.images:
        return True
    known = a.images is not None and all(a.images.digests)
    return known and image_key(a.images) == image_key(b.images)


def prompt_runs(requests: Sequence[GenerationRequest]) -> list[tuple[int, int]]:
    """[start, end) of each run of adjacent requests with the same prompt (`same_prompt`): each run is prefilled
    once."""
    runs: list[tuple[int, int]] = []
    for i, r in enumerate(requests):
        if runs and same_prompt(requests[runs[-1][0]], r):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def check_requests(requests: Sequence[GenerationRequest], takes_images: bool = False) -> None:
    """Raise a clear error for a request the engine cannot serve (an empty context; images, unless it takes them)."""
    for r in requests:
        if r.images is not None and not takes_images:
            raise HybridRLError(
                f"native engine: request (prompt {r.prompt_index}, sample {r.sample_index}) has images, which the "
                "fused decoder does not read; a vision-language model runs on the transformers path "
                "(engine.native.impl=hf or auto)"
            )
        if not r.prompt_ids:
            raise HybridRLError(
                f"native engine: request (prompt {r.prompt_index}, sample {r.sample_index}) has an "
                "empty prompt; give at least one token to generate from"
            )


class NativeEngineBase(RolloutEngine):
    """A rollout engine in this process over parameters it owns: sleep/wake, weight loading, the request form."""

    memory_gate: MemoryGate | None = None
    """What `set_memory_gate` set: called with the bytes about to be allocated (None: as much as it can get) before
    each large allocation, where the engine gates them (`gates_memory`)."""

    def set_memory_gate(self, gate: MemoryGate | None) -> None:
        self.memory_gate = gate if self.gates_memory else None

    def _make_room(self, nbytes: int | None) -> None:
        if self.memory_gate is not None:
            self.memory_gate(nbytes)

    def _init_weights(
        self,
        params: dict[str, torch.nn.Parameter],
        unique: dict[str, torch.nn.Parameter],
        device: torch.device,
        memory: FixedMemory | None = None,
    ) -> None:
        """Register the parameters `load_weights` fills by name (`params` may list a tied tensor under each of its
        names; `unique` once) and how they leave the device while asleep (`memory`: the `FixedMemory` they are views
        of)."""
        self.device = device
        self._params, self._unique = params, unique
        self._weight_offload = WeightOffloader(unique, device, memory)
        self._asleep: set[str] = set()

    # -- generation -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def generate_requests(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        """One completion per request, in order (params.n is ignored: each request is one sample). A request's
        random stream is keyed by (params.seed, prompt_index, sample_index); adjacent requests with equal
        prompt_ids share one prefill. Completion.prompt_index is the request's prompt_index."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[Completion]:
        outs = self.generate_requests(requests_of(prompts, params, images), params)
        return [dataclasses.replace(o, prompt_index=o.prompt_index - params.prompt_offset) for o in outs]

    def preserve_weights(self, names: Iterable[str]) -> None:
        """Keep these weights' values across every sleep level (at level 2 they are offloaded, not dropped): weights
        no reshard rewrites, such as a frozen vision tower."""
        names = set(names)
        unknown = sorted(names - set(self._unique))
        if unknown:
            raise HybridRLError(f"native engine: cannot preserve unknown weights {unknown[:3]}")
        self._weight_offload.preserve.update(names)

    def _check_awake(self, what: str) -> None:
        if self._asleep:
            raise HybridRLError(
                f"native engine: {what} called while {sorted(self._asleep)} are asleep; call wake_up first"
            )

    # -- memory lifecycle -----------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache; level 1 offloads the weights to pinned host memory (GPU; on CPU they stay where they
        are), level 2 drops them (the next reshard rewrites every one)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._free_cache()
        if self._weight_offload.offload(level):
            self._asleep.add("weights")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._asleep.add("kv_cache")

    def wake_up(self, tags: Sequence[str] = WAKE_TAGS) -> None:
        """Reallocate weights (restored from host after level 1, stale after level 2 until load_weights)
        and/or the KV cache."""
        unknown = set(tags) - set(WAKE_TAGS)
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; valid: {WAKE_TAGS}")
        if "weights" in tags and "weights" in self._asleep:
            self._make_room(self._weight_offload.device_bytes())
            self._weight_offload.restore()
            self._asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self._asleep:
            self._asleep.discard("kv_cache")
            self._allocate_cache()

    def _free_cache(self) -> None:
        """Release the KV cache (nothing to do where the cache lives only inside one call)."""

    def _allocate_cache(self) -> None:
        """Reallocate the KV cache after a sleep (nothing to do where it is allocated per call)."""

    # -- weights ----------------------------------------------------------------------------------------
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
        self._free_cache()
        self._params.clear()
        self._unique.clear()
        self._weight_offload.clear()
