"""The SGLang rollout engine: one `sglang.Engine` per engine TP group, owned by the group's leader rank.

How a worker drives it (every rank of the TP group makes the same calls in the same order; each is a collective
of the group)::

    eng = SglangEngine(path, cfg, topology=topology, seed=seed, device="cuda")
    eng.wake_up(["kv_cache"]); outs = eng.generate(prompts, params); eng.sleep(2)
    ...train...
    eng.wake_up(["weights"])                       # resume_memory_occupation(["weights"])
    eng.load_weights(layer_0); eng.load_weights(layer_1); ...   # first push opens begin_weight_update()
    eng.finish_weight_update()                     # end_weight_update() + flush_cache(); also done by
    eng.wake_up(["kv_cache"])                      #   wake_up(["kv_cache"]), sleep() and generate() if still open

Ranks: the leader (TP rank 0) builds `sglang.Engine(model_path=..., tp_size=..., base_gpu_id=..., ...)`, whose
scheduler processes run TP rank r on GPU base_gpu_id + r — the GPU of our TP rank r. The other ranks send the
leader their prompts (gather) and get their own completions back (scatter); identical calls of several ranks
(our WorkerGroup gives every rank of a TP group the same prompts) are generated once.

Weights: every rank flattens its HF-named full tensors into one uint8 buffer on its own GPU and serializes it
(CUDA-IPC handle, base64); the leader passes the TP-rank-ordered list to
`update_weights_from_tensor(named_tensors=payloads, load_format="flattened_bucket", flush_cache=False)`, so TP rank
r's scheduler maps rank r's buffer from its own GPU. HF names only: SGLang's loader rewrites names by substring and
breaks on fused `qkv_proj`/`gate_up_proj` names.

Memory: `sleep(2)` releases every tag (weights, kv_cache, cuda_graph; SGLang flushes its cache); `sleep(1)` does the
same when `engine.sglang.enable_weights_cpu_backup` keeps a host copy of the weights, else it releases kv_cache and
cuda_graph only (weights stay on the device, contents kept). `wake_up` resumes weights, then kv_cache + cuda_graph,
each after a barrier of the TP group (every rank's trainer has freed the memory), and never a tag that was not
released (SGLang would raise KeyError).

Images (a vision-language model.path): each prompt's processor output (`pixel_values`, `image_grid_thw`, the ones the
trainer reads) travels as the request's `image_data` with `input_ids` holding the expanded placeholders
(`hybridrl.engines.sglang.multimodal`); SGLang runs the tower, the mrope positions and its image-keyed prefix cache.

Log-probs: SGLang's default, log_softmax(logits / temperature) of the sampled token over the whole vocabulary
(before top-k/top-p), log_softmax(logits) for greedy — our definition. See `hybridrl.engines.sglang.requests`.
Seeds: sample j of global prompt i gets `sampling_seed = stream_key(seed, i, j) & (2**63 - 1)`; SGLang honours it
only with `engine.sglang.enable_deterministic_inference=true`.

Partial rollouts stop early (`sglang.partial`): each request through `async_generate` under an id of ours, the
unfinished ones aborted by id once enough groups are complete, coming back with what they sampled so far.

Verified on CPU with a stand-in engine and with SGLang's own serializer (tests/unit/engines/sglang); never run
against a live SGLang Engine (it needs CUDA kernels, absent from our machines).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from hybridrl.data.images import ImageInputs, image_key
from hybridrl.engines.base import WAKE_TAGS, Completion, GenerationRequest, RolloutEngine, SamplingParams
from hybridrl.engines.config import EngineConfig
from hybridrl.engines.sglang import payload as wire
from hybridrl.engines.sglang.control import check_result, model_eos_ids, sglang_engine_class
from hybridrl.engines.sglang.multimodal import ImageTokens, build_image_data
from hybridrl.engines.sglang.partial import run_partial
from hybridrl.engines.sglang.requests import (
    build_requests,
    build_turn_requests,
    params_key,
    parse_outputs,
    parse_turn_outputs,
)
from hybridrl.engines.sglang.stream import SglangRequestStream
from hybridrl.engines.sglang.tp import TpGroup
from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.topology import Topology

log = logging.getLogger(__name__)

ALL_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang.srt.constants
_GIB = 1 << 30
_FUSED_NAMES = (".qkv_proj.", ".gate_up_proj.")
_warned: set[str] = set()

# One rank's generate call: its prompts, the sampling parameters, in the request form each request's
# (prompt_index, sample_index) (None: `generate`'s params.n samples of each prompt), and each prompt's images (None:
# none has any).
Part = tuple[list[list[int]], SamplingParams, list[tuple[int, int]] | None, list[ImageInputs | None] | None]


class SglangEngine(RolloutEngine):
    """An SGLang Engine shared by one engine TP group; takes HF-named full tensors (SGLang fuses and splits)."""

    weight_layout_style = "hf"
    stops_early = True

    def __init__(
        self,
        model_path: str,
        cfg: EngineConfig,
        *,
        topology: Topology | None = None,
        seed: int = 0,
        device: str = "cuda",
        engine_factory: Callable[..., Any] | None = None,
    ) -> None:
        """Collective over the default group (builds the TP subgroups) and then over the TP group.

        `engine_factory(**kwargs)` builds the engine on the leader; default `sglang.Engine`. Tests pass a stand-in
        with the same methods.
        """
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
            raise ConfigError(
                "SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return log-probs of unscaled logits, but hybridrl "
                "compares log_softmax(logits / temperature) everywhere. Unset it."
            )
        self.cfg, self.device = cfg, torch.device(device)
        topology = topology or Topology(1)
        self.tp_rank, self.tp_size = topology.engine_tp_rank, topology.engine_tp_size
        factory = engine_factory if engine_factory is not None else sglang_engine_class()
        self.tp = TpGroup(topology)
        self.stop_ids = model_eos_ids(Path(model_path))
        self.image_tokens = ImageTokens.from_model(Path(model_path))
        self.takes_images = self.image_tokens is not None  # a vision-language checkpoint: prompts may carry images
        self._backup = cfg.sglang.enable_weights_cpu_backup
        self._released: set[str] = set()  # SGLang tags released and not resumed yet
        self._weights_stale = False  # released without a host copy: must be loaded before generating
        self._session_open = False  # between begin_weight_update and end_weight_update
        self._pushed = 0  # load_weights calls in the open session
        self._leading = False  # inside `lead` (the TP leader's agent rollout)
        self._engine: Any = None

        opts = cfg.sglang
        if cfg.dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        else:
            dtype = cfg.dtype
        self.engine_kwargs: dict[str, Any] = dict(
            model_path=str(model_path),
            tp_size=self.tp_size,
            base_gpu_id=self._base_gpu_id(),
            mem_fraction_static=opts.mem_fraction_static,
            enable_memory_saver=opts.enable_memory_saver,
            enable_weights_cpu_backup=opts.enable_weights_cpu_backup,
            enable_deterministic_inference=opts.enable_deterministic_inference,
            skip_tokenizer_init=True,  # token ids in and out
            random_seed=seed,
            dtype=dtype,
        )
        self.engine_kwargs.update(opts.engine_kwargs)

        def start() -> None:
            self._engine = factory(**self.engine_kwargs)

        self.tp.on_leader("start-up", start)

    # -- generation -------------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[Completion]:
        """Every rank passes its own prompts (and their images); the leader generates them all in one batch and
        returns each rank its own completions (prompt-major, `params.n` per prompt, prompt_index local to the rank)."""
        return self._through_leader(([[int(t) for t in p] for p in prompts], params, None, _images(images)))

    def generate_requests(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        """One completion per request (seeded from (seed, prompt_index, sample_index)), through the TP leader as
        `generate` goes. Agent turns come here one batch per turn only outside `lead` at engine.tp_size > 1."""
        ids = [[int(t) for t in r.prompt_ids] for r in requests]
        indices = [(r.prompt_index, r.sample_index) for r in requests]
        return self._through_leader((ids, params, indices, _images([r.images for r in requests])))

    def generate_partial(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        groups: Sequence[object],
        need: int,
        wait_for: Sequence[int] = (),
    ) -> list[Completion]:
        """One completion per request, in order, stopping once `need` groups are complete and the requests `wait_for`
        finished: the rest are aborted in SGLang and come back with their tokens and log-probs so far, finish_reason
        'partial' (`RolloutEngine.generate_partial`, `sglang.partial`). Each request is seeded as in
        `generate_requests` and capped by its own `max_new_tokens`. Every rank of the TP group passes the same
        requests; the leader's engine runs them once and every rank gets its completions."""
        self._check_can_generate()
        self._warn_unseeded(params)
        ids, sampling = build_turn_requests(requests, params, self.stop_ids)
        for r, sp in zip(requests, sampling, strict=True):
            if r.max_new_tokens is not None:
                sp["max_new_tokens"] = r.max_new_tokens
        indices = [(r.prompt_index, r.sample_index) for r in requests]
        caps = tuple(sp["max_new_tokens"] for sp in sampling)
        keys = self.tp.gather((params_key(ids, params, indices), caps, tuple(groups), need, tuple(wait_for)))

        def run() -> list[Completion]:
            if any(k != keys[0] for k in keys):
                raise HybridRLError("generate_partial: every rank of an engine TP group must pass the same requests")
            return self._engine.loop.run_until_complete(
                run_partial(self._engine, requests, ids, sampling, groups, need, wait_for)
            )

        return self.tp.on_leader("generate_partial", run)

    def async_engine(self, longest: int | None = None) -> SglangRequestStream | None:
        """Requests one at a time through SGLang's request API (`Engine.async_generate`, `sglang.stream`), each joining
        its running batch as it arrives: the agent loop's turns. With engine.tp_size > 1 only inside `lead` (the
        leader's engine runs every TP rank; the others `follow`, doing nothing meanwhile); else None, and the loop
        batches per turn through the leader (`generate_requests`). SGLang sizes its own KV cache."""
        if self.tp_size > 1 and not self._leading:
            return None
        self._check_can_generate()
        return SglangRequestStream(self._engine, self.stop_ids, self.image_tokens)

    @contextmanager
    def lead(self, group=None) -> Iterator[None]:
        """The TP leader's agent rollout at engine.tp_size > 1: inside, `async_engine` serves the loop's turns from
        SGLang's own request API. The other ranks have nothing to replay: the leader's engine runs their GPUs."""
        self._leading = True
        try:
            yield
        finally:
            self._leading = False

    def follow(self, group=None) -> None:
        """Another rank's part of the leader's agent rollout: nothing to do (its completions are the leader's); its
        next collective waits for the leader."""

    def _check_can_generate(self) -> None:
        self.finish_weight_update()
        if self._released:
            raise RuntimeError(f"generate while {sorted(self._released)} are released; call wake_up first")
        if self._weights_stale:
            raise RuntimeError("the engine's weights were released without a host copy; load_weights before generate")

    def _warn_unseeded(self, params: SamplingParams) -> None:
        if params.seed is not None and not self.cfg.sglang.enable_deterministic_inference:
            _warn_once(
                "seed",
                "SGLang honours per-sample seeds only with engine.sglang.enable_deterministic_inference=true; "
                "samples come from the engine's random_seed stream (not reproducible across layouts)",
            )

    def _through_leader(self, part: Part) -> list[Completion]:
        """Gather every rank's part (prompts, params, and for requests their (prompt_index, sample_index)) on the
        leader, generate the distinct ones in one engine call there, and hand each rank its completions."""
        self._check_can_generate()
        self._warn_unseeded(part[1])
        parts = self.tp.gather(part)
        results: list[Any] | None = None
        if self.tp.is_leader:
            try:
                results = self._generate_parts(parts)
            except Exception as exc:  # noqa: BLE001 -- every rank raises it below
                if self.tp.group is None:
                    raise
                log.exception("SGLang generate failed on the TP leader")
                results = [f"{type(exc).__name__}: {exc}"] * self.tp_size
        mine = self.tp.scatter(results)
        if isinstance(mine, str):
            raise HybridRLError(f"SGLang engine: generate failed on the TP leader (rank {self.tp.leader}): {mine}")
        return mine

    def _generate_parts(self, parts: list[Part]) -> list[list[Completion]]:
        """Leader: one engine call for the distinct parts (equal tokens with other pictures are distinct); each
        rank's completions."""
        unique: dict[tuple, int] = {}
        owner = [
            unique.setdefault((params_key(p, params, ix or ()), _image_keys(im)), len(unique))
            for p, params, ix, im in parts
        ]
        firsts = [parts[owner.index(u)] for u in range(len(unique))]
        input_ids: list[list[int]] = []
        sampling: list[dict[str, Any]] = []
        image_data: list[list[dict[str, Any]]] = []
        for prompts, params, indices, images in firsts:
            if indices is None:
                ids, sp = build_requests(prompts, params, self.stop_ids)
            else:
                ids, sp = build_turn_requests(_requests(prompts, indices), params, self.stop_ids)
            data = build_image_data(prompts, images, params.n if indices is None else 1, self.image_tokens)
            image_data += data if data is not None else [[] for _ in ids]
            input_ids += ids
            sampling += sp
        outputs = []
        if input_ids:
            extra = {"image_data": image_data} if any(image_data) else {}  # a text batch: the text payload unchanged
            outputs = self._engine.generate(input_ids=input_ids, sampling_params=sampling, return_logprob=True, **extra)
            if isinstance(outputs, dict):
                outputs = [outputs]
        per_part, start = [], 0
        for prompts, params, indices, _ in firsts:
            count = len(prompts) * (params.n if indices is None else 1)
            chunk = outputs[start : start + count]
            if indices is None:
                per_part.append(parse_outputs(chunk, params.n, len(prompts)))
            else:
                per_part.append(parse_turn_outputs(chunk, _requests(prompts, indices)))
            start += count
        if start != len(outputs):
            raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {start} requests")
        return [per_part[u] for u in owner]

    # -- memory -----------------------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Release device memory (the engine must be idle: SGLang asserts it and flushes its cache)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if not self.cfg.sglang.enable_memory_saver:
            _warn_once("saver", "engine.sglang.enable_memory_saver=false: SGLang's sleep frees no device memory")
        self.finish_weight_update()
        if level == 2 or self._backup:
            tags = list(ALL_TAGS)
        else:
            _warn_once(
                "level1",
                "sleep(level=1) keeps SGLang's weights on the device (enable engine.sglang.enable_weights_cpu_backup "
                "to offload them to host memory instead)",
            )
            tags = ["kv_cache", "cuda_graph"]
        tags = [t for t in tags if t not in self._released]
        if not tags:
            return
        # All tags → None, SGLang's own spelling of "everything".
        arg = None if set(tags) == set(ALL_TAGS) else tags
        self.tp.on_leader(
            f"release_memory_occupation({tags})", lambda: self._engine.release_memory_occupation(tags=arg)
        )
        self._released.update(tags)
        if "weights" in tags and not self._backup:
            self._weights_stale = True

    def wake_up(self, tags: Sequence[str] = WAKE_TAGS) -> None:
        """Resume `weights`, then `kv_cache` (with cuda_graph); waking kv_cache first closes an open weight update."""
        unknown = set(tags) - set(WAKE_TAGS)
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use {list(WAKE_TAGS)}")
        for tag in (t for t in WAKE_TAGS if t in tags):
            if tag == "kv_cache":
                self.finish_weight_update()
            resume = [
                t for t in (["weights"] if tag == "weights" else ["kv_cache", "cuda_graph"]) if t in self._released
            ]
            if not resume:
                continue
            self.tp.barrier()  # every rank of the group is here: its trainer has given back the memory
            self.tp.on_leader(
                f"resume_memory_occupation({resume})", lambda r=resume: self._engine.resume_memory_occupation(tags=r)
            )
            self._released.difference_update(resume)

    def memory_stats(self) -> dict[str, float]:
        """This rank's device figures (the engine's schedulers run in their own processes on the same GPUs)."""
        if self.device.type != "cuda":
            return {}
        free, total = torch.cuda.mem_get_info(self.device)
        return {"device_used_gb": (total - free) / _GIB}

    # -- weights ----------------------------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named full tensors (every rank of the TP group passes its own copy, same names and order).

        The first push after a wake opens SGLang's weight-update session; `finish_weight_update` closes it.
        """
        weights = list(named_tensors)
        if not weights:
            return
        if "weights" in self._released:
            raise RuntimeError("load_weights while the weights are released; call wake_up(['weights']) first")
        fused = [n for n, _ in weights if any(f in n for f in _FUSED_NAMES)]
        if fused:
            raise ValueError(f"SGLang takes HF names (q_proj/k_proj/v_proj, gate_proj/up_proj), got fused {fused[:3]}")
        bucket = wire.flatten_bucket(weights)
        payloads = self.tp.gather(wire.serialize(bucket))
        opened = self._session_open

        def push() -> None:
            if not opened:
                check_result(self._engine.begin_weight_update(), "begin_weight_update")
            try:
                check_result(
                    self._engine.update_weights_from_tensor(
                        named_tensors=payloads, load_format="flattened_bucket", flush_cache=False
                    ),
                    "update_weights_from_tensor",
                )
            except Exception:
                if not opened:  # leave no empty session behind: the next push opens a fresh one
                    self._engine.end_weight_update()
                raise

        # Returns on every rank only after the leader's call: our buffer stays alive while SGLang reads it.
        self.tp.on_leader(f"weight push of {len(weights)} tensors ({weights[0][0]}, ...)", push)
        self._session_open = True
        self._pushed += 1
        del bucket

    def finish_weight_update(self) -> None:
        """Close the open weight-update session: `end_weight_update()`, then one `flush_cache()`. A no-op when none
        is open. Call it on every rank of the TP group after the last `load_weights` of a sync."""
        if not self._session_open:
            return

        def end() -> None:
            check_result(self._engine.end_weight_update(), "end_weight_update")
            check_result(self._engine.flush_cache(), "flush_cache")

        self._session_open = False
        self.tp.on_leader("end_weight_update", end)
        if self._pushed:
            self._weights_stale = False
        self._pushed = 0
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # free the flat buffers SGLang's schedulers have let go of

    def shutdown(self) -> None:
        """Shut the engine down (leader); the object is unusable afterwards. Not a collective."""
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.shutdown()

    # -- placement --------------------------------------------------------------------------------------------

    def _base_gpu_id(self) -> int:
        """GPU of TP rank 0: `engine.sglang.base_gpu_id`, else the leader's device, after checking that the group's
        ranks sit on consecutive GPUs (SGLang puts TP rank r on base_gpu_id + r)."""
        if self.cfg.sglang.base_gpu_id >= 0:
            return self.cfg.sglang.base_gpu_id
        if self.device.type != "cuda":
            return 0
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        indices = self.tp.gather(index)

        def check() -> int:
            want = list(range(indices[0], indices[0] + self.tp_size))
            if indices != want:
                raise HybridRLError(
                    f"SGLang places TP rank r on GPU base_gpu_id + r, but this TP group's ranks use GPUs {indices}; "
                    "run workers on consecutive GPUs or set engine.sglang.base_gpu_id"
                )
            if torch.cuda.device_count() < want[-1] + 1:
                raise HybridRLError(
                    f"the TP leader sees {torch.cuda.device_count()} GPUs but SGLang needs GPUs {want}: "
                    "every GPU of the TP group must be visible to the leader (CUDA_VISIBLE_DEVICES)"
                )
            return indices[0]

        return self.tp.on_leader("GPU placement check", check)


# -- helpers ------------------------------------------------------------------------------------------------------


def _requests(prompts: list[list[int]], indices: list) -> list[GenerationRequest]:
    return [GenerationRequest(p, i, j) for p, (i, j) in zip(prompts, indices, strict=True)]


def _images(images: Sequence[ImageInputs | None] | None) -> list[ImageInputs | None] | None:
    """A part's images: None when no prompt has any (a text call keys and travels as before)."""
    if images is None or all(x is None for x in images):
        return None
    return list(images)


def _image_keys(images: list[ImageInputs | None] | None) -> tuple[str, ...]:
    """The images of a part by content, to tell equal tokens with other pictures apart."""
    return () if images is None else tuple(image_key(x) for x in images)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)
