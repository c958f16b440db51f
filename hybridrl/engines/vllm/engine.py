"""The vLLM rollout engine, colocated: vLLM runs inside the worker process, one vLLM TP rank per worker.

How a worker drives it (see `hybridrl.engines.base`)::

    eng = VllmEngine(path, cfg, topology=topology, seed=seed, device="cuda")
    eng.wake_up(["kv_cache"]); outs = eng.generate(prompts, params); eng.sleep(2)
    ...train...
    eng.wake_up(["weights"]); eng.load_weights(layer_0); eng.load_weights(layer_1); ...
    eng.wake_up(["kv_cache"])   # next generate

Construction and teardown are in `vllm.construction`, weight delivery in `vllm.weights`. Here:

- Log-probs: `logprobs_mode="processed_logprobs"`, `logprobs=0` gives log_softmax(logits / T) of the sampled
  token (T=1 when greedy) — our definition. With top-k / top-p on they are taken *after* the filter (renormalised
  over the kept tokens), so they differ from the trainer's full-vocabulary log-probs by log(kept mass).
  Against HF in float32 on CPU: max |Δ| 1.2e-6 at T=1 and T=0.7, also at TP=2 (tests assert 1e-4).
- Per-request seeds: vLLM seeds the n samples of a request `seed + j`; we seed prompt i from its global index
  (`stream_key(seed, prompt_offset + i, 0)`, 30 bits), so samples do not depend on the split over engine groups.
- Agent turns (`rollout=agent`) join vLLM's running batch one by one through `async_engine` (`vllm.stream`:
  `LLMEngine.add_request` and `step`); with engine.tp_size > 1 the TP leader's schedule is replayed by the other
  ranks (`lead`, `follow`).
- Partial rollouts (`rollout=partial`) stop early (`vllm.partial`): every request streams its tokens, and once enough
  groups are complete the rest are aborted and come back with what they sampled so far.
- TP on CPU uses shared memory named after VLLM_DIST_IDENT, which external_launcher fixes to "//" — two TP jobs
  on one host may collide (not checked); segments an exited worker left are removed first (`vllm.shm`).
- Harmless noise, dropped at vLLM's loggers (`quiet.py`): "Chat template warmup failed" (no tokenizer),
  "RotaryEmbedding/ParallelLMHead: Failed to load weights" on every push (modules with nothing to load keep their
  tensors; the tied head is re-packed in `vllm.weights`).
- Sleep mode is unsupported on CPU (`enable_sleep_mode=True` raises); there sleep/wake only keep the bookkeeping
  (and warn once). GPU: `enable_sleep_mode=True`, `llm.sleep(level)`, `llm.wake_up(tags)`; vLLM does not
  schedule until every tag is awake, so `generate` refuses to run while anything sleeps (it would hang).
- Harmless noise: "Chat template warmup failed" (no tokenizer).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from hybridrl.engines.base import WAKE_TAGS, Completion, GenerationRequest, RolloutEngine, SamplingParams
from hybridrl.engines.config import EngineConfig
from hybridrl.engines.lockstep import Lockstep, leading
from hybridrl.engines.sampling import stream_key
from hybridrl.engines.vllm.construction import (
    GIB,
    check_cpu_head_dim,
    eos_ids,
    llm_kwargs,
    local_device_index,
    teardown,
)
from hybridrl.engines.vllm.partial import run_partial
from hybridrl.engines.vllm.quiet import quiet_vllm_logs
from hybridrl.engines.vllm.shm import remove_stale_cpu_shm
from hybridrl.engines.vllm.stream import VllmRequestStream, replay
from hybridrl.engines.vllm.weights import check_whole_modules, checkpoint_modules, load_in_place, repack_tied_lm_head
from hybridrl.topology import Topology

log = logging.getLogger(__name__)

_warned_no_sleep = False


class VllmEngine(RolloutEngine):
    """A vLLM `LLM` in this process, taking HF-named full tensors (vLLM fuses and TP-splits them itself)."""

    weight_layout_style = "hf"
    stops_early = True

    def __init__(
        self,
        model_path: str,
        cfg: EngineConfig,
        *,
        topology: Topology | None = None,
        seed: int = 0,
        device: str = "cpu",
        cache_root: str | None = None,
        trust_remote_code: bool = False,
    ):
        """`cache_root`: vLLM's cache folder (VLLM_CACHE_ROOT); None = $VLLM_CACHE_ROOT or a fresh temp dir.
        Pass a folder of the run so nothing is written under the home folder."""
        import torch.distributed as dist

        self.cfg = cfg
        self.device = torch.device(device)
        self.on_cpu = self.device.type == "cpu"
        self.model_path = str(model_path)
        self._sleeping: set[str] = set()
        self._weights_discarded = False
        self._lockstep: Lockstep | None = None  # the TP group's schedule, inside `lead`
        hf_config = json.loads((Path(model_path) / "config.json").read_text())
        self.eos_token_ids = eos_ids(Path(model_path), hf_config)
        self._modules = checkpoint_modules(Path(model_path))
        self._tied_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        if self.on_cpu:
            check_cpu_head_dim(hf_config)

        topology = topology or Topology(1)
        tp_size = self.tp_size = topology.engine_tp_size
        self.owns_process_group = not (dist.is_available() and dist.is_initialized())
        if self.owns_process_group:
            if tp_size != 1:
                raise RuntimeError(
                    f"engine.tp_size={tp_size} needs torch.distributed initialized by the worker "
                    "(one process per TP rank); none is"
                )
            backend = "uni"
        else:
            # external_launcher: vLLM builds its TP groups from RANK / WORLD_SIZE as consecutive ranks, the same
            # groups as the run's Topology.
            backend = "external_launcher"
            os.environ["RANK"] = str(topology.rank)
            os.environ["LOCAL_RANK"] = str(local_device_index(self.device))

        self.llm_kwargs = llm_kwargs(
            self.model_path,
            cfg,
            tp_size=tp_size,
            seed=seed,
            on_cpu=self.on_cpu,
            backend=backend,
            cache_root=cache_root,
            trust_remote_code=trust_remote_code,
        )
        from vllm import LLM

        quiet_vllm_logs(self._tied_embeddings)
        if self.on_cpu and tp_size > 1:
            remove_stale_cpu_shm()
        set_num_threads = torch.set_num_threads
        try:
            self._llm = LLM(**self.llm_kwargs)
        finally:
            torch.set_num_threads = set_num_threads
        # Replace vLLM's own finalizer (it would destroy our process group) with ours.
        core_client = self._llm.llm_engine.engine_core
        core_client._finalizer.detach()
        self._finalizer = weakref.finalize(self, teardown, core_client.engine_core, self.owns_process_group)

    # -- generation -------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        self._check_awake()
        if not prompts:
            return []
        if params.seed is None:
            sp = self._vllm_params(params, params.n)
        else:
            # A request's n samples are seeded seed + j by vLLM; the request seed comes from the prompt's
            # global index, so samples do not depend on how prompts were split over engine groups.
            sp = [
                self._vllm_params(params, params.n, stream_key(params.seed, params.prompt_offset + i, 0))
                for i in range(len(prompts))
            ]
        outputs = self._llm.generate([self._input(p) for p in prompts], sp, use_tqdm=False)
        return [c for i, out in enumerate(outputs) for c in self._completions(i, out, params.n)]

    def generate_requests(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        """One completion per request, all in one `LLM.generate` call (vLLM batches them continuously inside it);
        each request is seeded from (seed, prompt_index, sample_index). Agent turns come here one batch per turn
        only outside `lead` at engine.tp_size > 1."""
        self._check_awake()
        if not requests:
            return []
        sp = [self._request_params(params, r) for r in requests]
        outputs = self._llm.generate([self._input(r.prompt_ids) for r in requests], sp, use_tqdm=False)
        return [self._completion(r.prompt_index, o) for r, o in zip(requests, outputs, strict=True)]

    def generate_partial(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        groups: Sequence[object],
        need: int,
        wait_for: Sequence[int] = (),
    ) -> list[Completion]:
        """One completion per request, in order, stopping after the first engine step at whose end `need` groups are
        complete and the requests `wait_for` finished; the requests still running are aborted and come back with
        their tokens and log-probs so far, finish_reason 'partial' (`RolloutEngine.generate_partial`, `vllm.partial`).
        Each request is seeded as in `generate_requests` and capped by its own `max_new_tokens`. Every rank of an
        engine TP group runs it with the same requests and stops after the same step."""
        self._check_awake()
        sampling = []
        for r in requests:
            sp = self._request_params(params, r)
            if r.max_new_tokens is not None:
                sp.max_tokens = r.max_new_tokens
            sampling.append(sp)
        return run_partial(self._llm.llm_engine, requests, sampling, groups, need, wait_for)

    def async_engine(self, longest: int | None = None) -> VllmRequestStream | None:
        """Requests one at a time, each joining vLLM's running batch at its next step (`vllm.stream`), for the agent
        loop's turns. With engine.tp_size > 1 only inside `lead`: every rank must add the same requests before the
        same steps, so the leader's stream sends them and the other ranks replay them (`follow`); else None. vLLM
        sizes its own KV cache, so `longest` is not needed."""
        if self.tp_size > 1 and self._lockstep is None:
            return None
        self._check_awake()
        return VllmRequestStream(self._llm, self._request_params, self._completion, self._lockstep)

    @contextmanager
    def lead(self, group) -> Iterator[None]:
        """The TP leader's agent rollout at engine.tp_size > 1 (`engines/lockstep.py`; `group`: the TP group on a host
        backend): inside, `async_engine`'s stream sends each step's new requests to the other ranks, which `follow`;
        leaving the block ends their phase, or fails it with the block's error."""
        try:
            with leading(group) as self._lockstep:
                yield
        finally:
            self._lockstep = None

    def follow(self, group) -> None:
        """Another rank's part of the leader's agent rollout (`lead`): the leader's requests and steps replayed on this
        rank's engine until its phase ends. The outputs are the leader's; this rank runs no agent loop and no tool."""
        self._check_awake()
        replay(self._llm, Lockstep(group))

    def _request_params(self, params: SamplingParams, request: GenerationRequest):
        """vLLM's SamplingParams of one request: one sample, seeded from its stream key."""
        key = None if params.seed is None else stream_key(params.seed, request.prompt_index, request.sample_index)
        return self._vllm_params(params, 1, key)

    def _completion(self, index: int, out) -> Completion:
        (c,) = self._completions(index, out, 1)
        return c

    def _check_awake(self) -> None:
        if self._sleeping:
            raise RuntimeError(f"generate while {sorted(self._sleeping)} sleep; call wake_up first")
        if self._weights_discarded:
            raise RuntimeError("sleep(level=2) discarded the weights; load_weights before generate")

    def _vllm_params(self, params: SamplingParams, n: int, key: int | None = None):
        """vLLM's SamplingParams for ours: n samples, processed log-probs of the sampled tokens, token ids only."""
        from vllm import SamplingParams as VSP

        base = dict(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            stop_token_ids=sorted(set(params.stop_token_ids) | set(self.eos_token_ids)),
            logprobs=0,
            detokenize=False,
        )
        return VSP(**base) if key is None else VSP(**base, seed=key & 0x3FFFFFFF)

    @staticmethod
    def _input(ids: Sequence[int]) -> dict:
        return {"prompt_token_ids": [int(t) for t in ids]}

    @staticmethod
    def _completions(index: int, out, n: int) -> list[Completion]:
        """Our completions of one vLLM request output, sample order."""
        if len(out.outputs) != n:
            raise RuntimeError(f"vLLM returned {len(out.outputs)} samples for prompt {index}, expected {n}")
        completions = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM sample {index}/{c.index} finished with {c.finish_reason!r}")
            ids = list(c.token_ids)
            lps = [pos[t].logprob for pos, t in zip(c.logprobs, ids, strict=True)]
            completions.append(Completion(index, ids, lps, c.finish_reason))
        return completions

    # -- memory -----------------------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.on_cpu:
            _warn_no_sleep_once()
            self._llm.reset_prefix_cache()
        else:
            self._llm.sleep(level=level)
        self._sleeping.update(WAKE_TAGS)
        if level == 2:
            self._weights_discarded = True

    def wake_up(self, tags: Sequence[str] = WAKE_TAGS) -> None:
        unknown = set(tags) - set(WAKE_TAGS)
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use {list(WAKE_TAGS)}")
        tags = [t for t in WAKE_TAGS if t in tags and t in self._sleeping]  # weights before kv_cache
        if not tags:
            return
        if not self.on_cpu:
            self._llm.wake_up(tags=tags)
        self._sleeping.difference_update(tags)

    def memory_stats(self) -> dict[str, float]:
        if self.on_cpu:
            import psutil

            rss = psutil.Process().memory_info().rss
            return {"rss_gb": rss / GIB, "kv_cache_gb": self.cfg.vllm.kv_cache_memory_gb}
        free, total = torch.cuda.mem_get_info(self.device)
        return {
            "allocated_gb": torch.cuda.memory_allocated(self.device) / GIB,
            "reserved_gb": torch.cuda.memory_reserved(self.device) / GIB,
            "device_used_gb": (total - free) / GIB,
        }

    # -- weights ----------------------------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named full (un-sharded) tensors; each module's tensors complete (q/k/v and their biases together,
        gate/up together). May be called layer by layer; modules not in a push keep their weights."""
        weights = list(named_tensors)
        if not weights:
            return
        check_whole_modules((name for name, _ in weights), self._modules)
        if self.on_cpu:
            kwargs = dict(weights_iterator=weights, is_checkpoint_format=True)
            self._llm.collective_rpc("reload_weights", kwargs=kwargs)
            if self._tied_embeddings and any(name.endswith("embed_tokens.weight") for name, _ in weights):
                self._llm.collective_rpc(repack_tied_lm_head)
        else:
            self._llm.collective_rpc(load_in_place, args=(weights,))
        self._llm.reset_prefix_cache()
        self._weights_discarded = False

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """vLLM's own parameters (fused qkv_proj/gate_up_proj, this rank's TP shard), where they are readable."""
        params = self._llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.named_parameters()
        params = list(params)
        empty = [n for n, p in params if p.numel() == 0]
        if empty:
            raise NotImplementedError(
                f"vLLM on {self.device.type} repacked {len(empty)} weights into kernel layouts (e.g. {empty[0]} "
                "is empty; CPU linears live in oneDNN blobs), so they cannot be read back"
            )
        return params

    def shutdown(self) -> None:
        """Free the engine; a new VllmEngine can be built in this process afterwards."""
        if self._finalizer.alive:
            self._finalizer()
        self._llm = None
        gc.collect()


def _warn_no_sleep_once() -> None:
    global _warned_no_sleep
    if not _warned_no_sleep:
        _warned_no_sleep = True
        log.warning(
            "vLLM has no sleep mode on CPU: sleep()/wake_up() free no memory on this platform "
            "(the engine keeps its weights and KV cache resident)"
        )
