"""Config of the rollout engine (`engine=native|vllm|sglang`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridrl.errors import ConfigError

ENGINE_NAMES = ("native", "vllm", "sglang")
NATIVE_IMPLS = ("auto", "fused", "hf")
PDL_MODES = ("on", "off")
PDL_ALIASES = {"true": "on", "false": "off", "1": "on", "0": "off"}


@dataclass
class VllmOptions:
    """Options only the vLLM engine reads (`engine.vllm.*`)."""

    gpu_memory_utilization: float = 0.5
    """Fraction of the device vLLM may take (weights + KV); the trainer's resident memory counts against it."""
    kv_cache_memory_gb: float = 1.0
    """KV cache size in GiB; used on CPU (VLLM_CPU_KVCACHE_SPACE) and, when > 0 on GPU, instead of the fraction."""
    enforce_eager: bool = True
    """Disable CUDA graphs / torch.compile (fast start-up; turn off for decode speed on GPU)."""
    enable_prefix_caching: bool = False
    """Reuse KV of shared prompt prefixes (the n samples of a prompt share one prefix)."""
    max_num_seqs: int = 256
    """Most sequences vLLM schedules at once."""
    max_model_len: int = 0
    """Longest prompt + completion vLLM accepts (sizes its KV bookkeeping); 0 = the model's own limit."""

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"engine.vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_gb < 0:
            raise ConfigError(f"engine.vllm.kv_cache_memory_gb must be >= 0, got {self.kv_cache_memory_gb}")
        if self.max_model_len < 0:
            raise ConfigError(
                f"engine.vllm.max_model_len must be >= 0 (0 = the model's limit), got {self.max_model_len}"
            )


@dataclass
class SglangOptions:
    """Options only the SGLang engine reads (`engine.sglang.*`)."""

    mem_fraction_static: float = 0.5
    """Fraction of device memory SGLang reserves for weights + KV cache."""
    enable_memory_saver: bool = True
    """Use torch_memory_saver so release/resume_memory_occupation really frees memory."""
    base_gpu_id: int = -1
    """First GPU of this engine's TP group; -1 = derive from the worker's local rank."""
    enable_weights_cpu_backup: bool = False
    """Keep a host copy of the weights on release, so sleep(level=1) frees weight memory and keeps the contents."""
    enable_deterministic_inference: bool = False
    """Batch-invariant kernels; needed for SGLang to honour per-sample seeds (slower decode)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra sglang.Engine (ServerArgs) keyword arguments, e.g. {context_length: 4096, attention_backend: fa3}."""


@dataclass
class NativeOptions:
    """Options only the built-in engine reads (`engine.native.*`)."""

    impl: str = "auto"
    """fused (our decoder for llama/qwen2/qwen3, paged KV cache, TP-sharded), hf (the transformers model),
    or auto (fused when the architecture is supported, else hf)."""
    max_batch_size: int = 256
    """Most sequences decoded at once (more requests wait for a free row)."""
    cuda_graphs: bool = True
    """Fused engine on GPU: run each decode step (forward, sampling, bookkeeping) as a CUDA graph per batch bucket."""
    sampler_kernel: bool = True
    """On GPU: sample plain-temperature, seeded rows with the fused Triton kernel."""
    kernels: bool = True
    """Fused engine on GPU: Triton kernels for decode attention, RoPE + KV write and fused norms (else torch ops)."""
    max_model_len: int = 0
    """Fused engine: most prompt + completion tokens of one sequence; 0 = no fixed limit (the KV cache is sized
    by demand and grows between batches)."""
    prefill_tokens: int = 16384
    """Fused engine: most prompt tokens (padded, for long new prompts) prefilled in one forward, and the largest
    packed prefill a CUDA graph is captured for; bounds activation memory."""
    kv_block_size: int = 16
    """Fused engine: tokens per KV-cache block (the unit of allocation and of prompt sharing)."""
    kv_blocks: int = 0
    """Fused engine: KV-cache blocks allocated at wake-up; 0 = sized by `kv_memory_fraction`, else by demand."""
    prefix_cache: bool = True
    """Fused engine: keep full KV blocks findable by their tokens, so a request that starts like an earlier one
    (the next turn of an agent loop) prefills only what is new; emptied whenever weights are loaded."""
    kv_memory_fraction: float = 0.0
    """Fused engine on GPU, with kv_blocks = 0: size the KV cache to this fraction of the device memory free at
    wake-up; 0 = by demand (max_batch_size sequences of the longest request, grown when idle)."""
    join_wait_steps: int = 8
    """Fused engine: decode steps a request that would prefill apart may wait to join a running batch, so that
    requests arriving close together share one prefill instead of one each, counted from when a row is free; they
    join at once when an eighth of the rows (at least 2) can, or nothing runs. Joins inside a decode step
    (`join_step_tokens`) never wait. 0 = join at the next step."""
    join_step_tokens: int = 512
    """Fused engine: most prompt tokens computed inside one decode step when single requests join a running batch (a
    mixed step, what vLLM calls chunked prefill; an agent's next turn past its cached prefix, on GPU also a new prompt
    ≤ 512 tokens): they run as extra rows of that step and the joining rows sample their first token in it, instead of
    a separate prefill. More, or groups of samples sharing a prompt, prefill apart. 0 = every join prefills apart."""

    shared_prefix_tokens: int = 512
    """Fused engine on GPU: decode attention reads the KV blocks that rows share (a GRPO group's prompt) once per group
    rather than once per row, when the running rows share at least this many tokens on average. Measured on the H200
    at 256 rows of the 1.5B (groups of 8): 512 shared tokens saved 8–15 µs of a layer's 38–76; 128 saved nothing
    (-3 to +2), and the 0.5B lost 6–8 µs at 128. 0 = never."""

    fixed_addresses: bool = True
    """Fused engine on GPU: keep the weights and the KV cache at fixed device addresses (CUDA virtual memory), so that
    a sleep gives their memory back but the CUDA graphs survive it and the next rollout captures none (the KV cache
    keeps its size across sleeps). In the 1.5B GRPO step on the H200: graph capture 45 ms → 0 per rollout, rollout
    83.7k → 86.7k tok/s. Where the driver refuses (or not CUDA) the engine allocates through torch and captures its
    graphs again after each sleep."""

    pdl: str = "on"
    """Fused engine on an NVIDIA GPU of compute capability ≥ 9 (Hopper): "on" launches the Triton kernels with
    programmatic dependent launch, so each one's programs start while the kernel ahead finishes and wait for its writes
    (`kernels/pdl.py`); "off" launches them in plain stream order. Elsewhere it has no effect. In a fresh process on
    the H200 the 1.5B GRPO rollout ran 2–3% faster with it; in a process that has run training steps the gain varies
    from run to run, between none and ~1% slower: set "off" where a benchmark of your own run (`python -m
    benchmarks.engine`) measures it faster."""

    def __post_init__(self) -> None:
        # Booleans are accepted too: true → on, false → off (`engine.native.pdl=true` arrives as "True").
        self.pdl = PDL_ALIASES.get(str(self.pdl).lower(), str(self.pdl).lower())
        if self.pdl not in PDL_MODES:
            raise ConfigError(f"engine.native.pdl must be one of {', '.join(PDL_MODES)}, got {self.pdl!r}")
        if self.impl not in NATIVE_IMPLS:
            raise ConfigError(f"engine.native.impl must be one of {', '.join(NATIVE_IMPLS)}, got {self.impl!r}")
        if self.max_batch_size < 1:
            raise ConfigError(f"engine.native.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_model_len < 0:
            raise ConfigError(
                f"engine.native.max_model_len must be >= 0 (0 = no fixed limit), got {self.max_model_len}"
            )
        if self.prefill_tokens < 1:
            raise ConfigError(f"engine.native.prefill_tokens must be >= 1, got {self.prefill_tokens}")
        if self.kv_block_size < 1 or self.kv_block_size & (self.kv_block_size - 1):
            raise ConfigError(f"engine.native.kv_block_size must be a power of two, got {self.kv_block_size}")
        if self.kv_blocks < 0:
            raise ConfigError(f"engine.native.kv_blocks must be >= 0 (0 = sized automatically), got {self.kv_blocks}")
        if self.join_wait_steps < 0:
            raise ConfigError(f"engine.native.join_wait_steps must be >= 0, got {self.join_wait_steps}")
        if self.join_step_tokens < 0:
            raise ConfigError(
                f"engine.native.join_step_tokens must be >= 0 (0 = joins prefill apart), got {self.join_step_tokens}"
            )
        if self.shared_prefix_tokens < 0:
            raise ConfigError(
                f"engine.native.shared_prefix_tokens must be >= 0 (0 = never), got {self.shared_prefix_tokens}"
            )
        if not 0 <= self.kv_memory_fraction < 1:
            raise ConfigError(f"engine.native.kv_memory_fraction must be in [0, 1), got {self.kv_memory_fraction}")


@dataclass
class EngineConfig:
    """The rollout engine and how it samples."""

    name: str = "native"
    """Which engine: native (built in), vllm or sglang."""
    tp_size: int = 1
    """Engine tensor-parallel degree: groups of tp_size consecutive ranks share one engine."""
    dtype: str = "auto"
    """Engine weight dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16."""
    max_new_tokens: int = 16
    """Most tokens generated per sample."""
    temperature: float = 1.0
    """Sampling temperature for rollouts (log-probs everywhere use logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling; 1.0 disables it."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a sample (the tokenizer's EOS always does)."""
    sleep_level: int = 2
    """Level for sleep after generation: 1 keeps weights in host memory, 2 drops them (the reshard refills), 0 stays
    awake (frees nothing: the CUDA graphs, weights and KV cache stay for the next rollout; for a device with room for
    the engine beside every training phase)."""
    native: NativeOptions = field(default_factory=NativeOptions)
    """Options of the built-in engine only."""
    vllm: VllmOptions = field(default_factory=VllmOptions)
    """vLLM-only options."""
    sglang: SglangOptions = field(default_factory=SglangOptions)
    """SGLang-only options."""

    def __post_init__(self) -> None:
        if self.name not in ENGINE_NAMES:
            raise ConfigError(f"engine.name must be one of {', '.join(ENGINE_NAMES)}, got {self.name!r}")
        if self.tp_size < 1:
            raise ConfigError(f"engine.tp_size must be >= 1, got {self.tp_size}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"engine.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"engine.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"engine.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"engine.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"engine.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.sleep_level not in (0, 1, 2):
            raise ConfigError(f"engine.sleep_level must be 0 (stay awake), 1 or 2, got {self.sleep_level}")
