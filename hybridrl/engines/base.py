"""The rollout-engine interface every engine (native, vLLM, SGLang) implements.

A worker drives its engine through one iteration like this::

    engine.wake_up(["kv_cache"])              # weights were refreshed by the last reshard
    outs = engine.generate(prompts, params)   # token ids in, token ids + log-probs out
    engine.sleep(level=2)                     # give the device to the trainer
    ...train...
    engine.wake_up(["weights"])               # memory back; contents stale at level 2
    engine.load_weights(named_tensors)        # the resharder delivers the new weights
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybridrl.data.images import ImageInputs

WAKE_TAGS: tuple[str, ...] = ("weights", "kv_cache")

#: Called by an engine with the bytes it is about to allocate on its device (None: as much as it can get).
MemoryGate = Callable[[int | None], None]


@dataclass
class SamplingParams:
    """How to sample one batch of prompts (the engine-independent subset every engine honors)."""

    n: int = 1
    """Samples per prompt; a prompt's samples come back contiguous."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (log-probs are then taken at temperature 1)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it (and the full-vocab sort it needs)."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 disables it."""
    max_new_tokens: int = 32
    """Hard cap on generated tokens per sample."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a sample (in addition to the tokenizer's EOS); the stop token is kept."""
    seed: int | None = None
    """Base seed of this call. With it, sample j of prompt i draws from a random stream fixed by
    (seed, prompt_offset + i, j), so samples do not depend on how prompts are split over workers,
    chunked or batched. None: the engine's own generator."""
    prompt_offset: int = 0
    """Global index of this call's first prompt (the worker group sets it when it splits prompts)."""


@dataclass
class GenerationRequest:
    """One sample to generate: the request-level form of `generate` (continuous batching, agent turns).

    `generate(prompts, params)` is `generate_requests` over `GenerationRequest(prompts[i], params.prompt_offset + i, j)`
    for every prompt i and sample j < params.n: the random stream of a request is keyed by
    (params.seed, prompt_index, sample_index) alone, so the same request draws the same tokens however it is batched.
    """

    prompt_ids: list[int]
    """The whole context to continue (prompt, and for later agent turns every token since)."""
    prompt_index: int
    """Global index of the prompt this sample belongs to (a key of its random stream)."""
    sample_index: int = 0
    """Which of the prompt's samples this is (the other key of its random stream)."""
    max_new_tokens: int | None = None
    """This request's own token cap (a sample continued from an earlier rollout: the tokens it has left); None:
    `SamplingParams.max_new_tokens`."""
    images: ImageInputs | None = None
    """A vision-language prompt's images (`prompt_ids` holds their placeholders); None for text."""


@dataclass
class Completion:
    """One generated sample."""

    prompt_index: int
    """Index of the prompt (in the list given to `generate`) this sample answers."""
    token_ids: list[int]
    """Generated token ids, the stop token included when one was hit."""
    logprobs: list[float]
    """Per generated token: log_softmax(logits / temperature)[token] (temperature 1 when greedy)."""
    finish_reason: str
    """'stop' (EOS or a stop id), 'length' (hit max_new_tokens), or 'partial' (`generate_partial` stopped it first:
    the tokens sampled so far)."""


def cap_completion(c: Completion, max_new_tokens: int) -> Completion:
    """`c` cut to `max_new_tokens` tokens (then finish_reason 'length'). Exact for engines whose token k depends only on
    the context and the request's stream, as every engine here does: a longer cap only adds tokens after the ones the
    shorter cap would have returned."""
    if len(c.token_ids) <= max_new_tokens:
        return c
    return Completion(c.prompt_index, c.token_ids[:max_new_tokens], c.logprobs[:max_new_tokens], "length")


class GroupCountdown:
    """When to stop a partial rollout: `need` groups complete (a group is complete when every one of its requests has
    finished) and every request of `wait_for` finished. `groups[i]` is request i's group (any hashable id)::

        countdown = GroupCountdown(groups, need, wait_for)
        for i in finished_request_indices: if countdown.finish(i): stop
    """

    def __init__(self, groups: Sequence[object], need: int, wait_for: Sequence[int] = ()) -> None:
        self.groups, self.need = list(groups), need
        self._left: dict[object, int] = {}
        for g in self.groups:
            self._left[g] = self._left.get(g, 0) + 1
        self.complete = 0
        self._waiting = set(wait_for)

    @property
    def done(self) -> bool:
        """Whether `need` groups are complete and no request of `wait_for` is still running."""
        return self.complete >= self.need and not self._waiting

    def finish(self, request: int) -> bool:
        """Request `request` finished; whether the rollout may stop now."""
        group = self.groups[request]
        self._left[group] -= 1
        if self._left[group] == 0:
            self.complete += 1
        self._waiting.discard(request)
        return self.done


class RolloutEngine(abc.ABC):
    """A rollout copy of the policy that generates from token ids and receives weights by name.

    The engine owns its own copy of the weights; it sees new weights only through
    `load_weights`, fed by the resharding manager in the layout `weight_layout_style` names.
    """

    #: "hf" = the engine takes HF-named full tensors and splits them itself (vLLM, SGLang);
    #: "fused" = the engine holds fused qkv/gate_up tensors sharded by its TP rank (native TP).
    weight_layout_style: str = "hf"

    #: True for an engine built with uninitialized weights: its builder fills them with the resharder before the
    #: first generate (the native fused engine); False when it loads the checkpoint itself.
    starts_empty: bool = False

    #: True for an engine that calls its memory gate (`set_memory_gate`) before each large device allocation (weights
    #: at wake-up, the KV cache), so the trainer's state may stay on the device until the engine needs its room
    #: (`trainer.offload_lazy`, workers/device_room.py); False: the worker offloads the trainer's state at wake-up.
    gates_memory: bool = False

    #: Whether `generate` takes images (vision-language models); engines that cannot refuse them by name.
    takes_images: bool = False

    @abc.abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[Completion]:
        """Sample `params.n` completions per prompt; returns len(prompts) * n items, prompt-major. `images[i]` are
        prompt i's images (a vision-language model; its placeholders are in `prompts[i]`), None for none."""

    #: True for an engine whose `generate_partial` stops as soon as enough groups are complete; False: it runs every
    #: request to its end (partial rollouts then only over-sample).
    stops_early: bool = False

    def generate_requests(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        """One completion per request, in order (`params.n` is ignored); the request form of `generate`, used by
        agent loops and continuous batching."""
        raise NotImplementedError(f"{type(self).__name__} does not generate from requests")

    def generate_partial(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        groups: Sequence[object],
        need: int,
        wait_for: Sequence[int] = (),
    ) -> list[Completion]:
        """One completion per request, in order, stopping as soon as `need` groups are complete (`groups[i]` is
        request i's group; a group is complete when all its requests have finished) and the requests `wait_for`
        (indices) have finished: every request still running then comes back with the tokens and log-probs sampled
        so far and finish_reason 'partial' (none sampled yet: an empty one). Each request's own `max_new_tokens`
        caps it. An engine may run on past that point while no unfinished request has a tail (more of its cap left
        than any request has sampled): stopping then saves nothing worth a stale sample.

        This default cannot stop early (`stops_early` False): it runs every request to its end through
        `generate_requests` and cuts each to its own cap."""
        outs = self.generate_requests(requests, params)
        return [
            cap_completion(c, r.max_new_tokens) if r.max_new_tokens is not None else c for r, c in zip(requests, outs)
        ]

    @abc.abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Release device memory: level 1 frees the KV cache and offloads the weights to host memory,
        level 2 frees the weights too (the next load overwrites them)."""

    @abc.abstractmethod
    def wake_up(self, tags: Sequence[str] = WAKE_TAGS) -> None:
        """Restore what `sleep` released; `weights` before `kv_cache`, so weights can be
        resynced before the KV cache is reallocated."""

    @abc.abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the given tensors (names and layout per `weight_layout_style`) into the engine."""

    def finish_weight_update(self) -> None:
        """Called once after the last `load_weights` of a sync (engines with update sessions close them here)."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The engine's current weights by name, for verification; engines that cannot expose
        them (a remote process) raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its weights")

    def memory_stats(self) -> dict[str, float]:
        """Engine-side memory figures in GiB (empty where the engine cannot tell)."""
        return {}

    # -- device memory shared with the trainer ------------------------------------------------------------------
    def set_memory_gate(self, gate: MemoryGate | None) -> None:
        """Call `gate(nbytes)` before each large device allocation from now on; None: stop. Engines that do not gate
        their allocations (`gates_memory` False) ignore it."""

    def mapped_bytes(self) -> int:
        """Device memory the engine maps itself through the CUDA driver, outside torch's caching allocator (which
        `torch.cuda.memory_allocated` does not count), held now; 0 for engines that allocate through torch."""
        return 0

    def take_peak_mapped_bytes(self) -> int:
        """The most `mapped_bytes` held at once since the last call (as `torch.cuda.max_memory_allocated` is for torch's
        allocator); the next peak starts from what is held now."""
        return 0

    def take_stats(self) -> dict[str, float]:
        """Engine figures accumulated since the last call, as step metrics (empty where the engine keeps none)."""
        return {}

    def shutdown(self) -> None:
        """Free every resource the engine holds; the object is unusable afterwards."""
