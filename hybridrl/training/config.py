"""Config of the FSDP2 trainer (`trainer.*`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from hybridrl.errors import ConfigError
from hybridrl.training.attention import PACKED_ATTENTION
from hybridrl.training.micro_batches import Batching

OFFLOAD_PARTS = ("params", "optimizer")


def parse_offload(value: Any) -> list[str]:
    """`trainer.offload` as a list of parts: [params,optimizer] / params / none / [] (and, from Python, the
    older comma string "params,optimizer"). Raises ConfigError naming trainer.offload for anything else."""
    if value is None:
        items: list[Any] = []
    elif isinstance(value, str):
        items = [] if value.strip().lower() in ("", "none") else value.split(",")
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ConfigError(f"trainer.offload must be a list of {list(OFFLOAD_PARTS)} or none, got {value!r}")
    parts: list[str] = []
    for item in items:
        part = str(item).strip()
        if part not in OFFLOAD_PARTS:
            raise ConfigError(
                f"trainer.offload: unknown part {part!r}; use a list of {', '.join(OFFLOAD_PARTS)} "
                f"(trainer.offload=[params,optimizer], trainer.offload=params) or trainer.offload=none"
            )
        if part not in parts:
            parts.append(part)
    return parts


@dataclass
class TrainerConfig:
    """The training copy of the policy: FSDP2, AdamW, schedule, batching, checkpoints."""

    steps: int = 60
    """RL iterations (rollout + update) to run."""
    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr."""
    lr_schedule: str = "constant"
    """After warmup: constant or cosine (down to min_lr_ratio * lr at the last optimizer step)."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of lr."""
    max_nonfinite_steps: int = 5
    """Optimizer steps in a row with a non-finite loss or gradient norm (each skipped) before the run stops."""
    max_param_norm_ratio: float = 2.0
    """Divergence guard: an optimizer step that scales the trained parameters' global L2 norm by more than this
    factor (or below its inverse), or leaves it non-finite, stops the run (DivergenceError) before the step's weights
    reach the engine or a checkpoint. Healthy steps change it by well under 1%; 0 turns the guard off."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (<= 0 disables clipping; the norm is still logged)."""
    mini_batch_size: int = 0
    """Sequences per optimizer step across all ranks; 0 = the whole rollout batch (one step per epoch)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward on one rank (gradients accumulate over micro-batches); unused under a token
    budget (max_tokens_per_micro_batch)."""
    max_tokens_per_micro_batch: int = 0
    """Token budget (prompt + response) of one forward/backward on one rank instead of a row count (verl's
    use_dynamic_bsz with ppo_max_token_len_per_gpu): rows are spread over the fewest micro-batches that stay within
    it, tokens balanced, the same number on every rank; a longer sequence runs alone. 0 = micro_batch_size rows."""
    logprob_max_tokens_per_micro_batch: int = 0
    """Token budget of the no-grad passes (old and reference log-probs), which keep no activations and can take more
    (verl's log_prob_max_token_len_per_gpu); 0 = max_tokens_per_micro_batch."""
    padding_free: bool = True
    """Pack each micro-batch's sequences end to end in one row, attention kept within each sequence, so no position
    is spent on padding (verl's use_remove_padding); false right-pads rows to the longest (for a model whose
    attention ignores packed position_ids)."""
    packed_attention: str = "auto"
    """How packed sequences are kept apart: varlen (one variable-length attention call: FlashAttention's varlen
    kernel on GPU, one causal sdpa per sequence on CPU), model (model.attn_implementation on the packed
    position_ids: flash_attention_2 reads the boundaries, sdpa/eager build a [tokens, tokens] block mask), or auto
    (varlen for sdpa, the model's own otherwise)."""
    sequence_parallel_size: int = 1
    """Ulysses sequence parallelism (verl's ulysses_sequence_parallel_size): each packed micro-batch of the actor,
    reference and critic is split along its tokens over this many consecutive ranks, which exchange attention heads
    for tokens around attention (all-to-all); the data-parallel ranks become workers / this. Token budgets stay per
    device: a micro-batch holds up to this many times max_tokens_per_micro_batch. Needs padding_free and the varlen
    packed attention, and num_attention_heads divisible by it (KV heads are repeated where they do not divide).
    1 = off."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per iteration."""
    param_dtype: str = "auto"
    """FSDP2 mixed-precision compute dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16."""
    logprob_chunk_size: int = 8192
    """Most positions whose logits exist at once; a pass with more goes through the head in chunks (0 = never)."""
    fused_logprobs: bool = True
    """On GPU, token log-probs from the logits in one fused Triton pass each way (no float32 logits copy)."""
    fused_optimizer: bool = True
    """On GPU, torch's fused AdamW (one kernel over all parameters) instead of its foreach chain."""
    fsdp_layers_per_unit: int = 0
    """Decoder layers per FSDP unit (each unit gathers and reduces its parameters together); 0 = auto (all layers in
    one unit up to 2B trained parameters, else 4 per unit)."""
    reshard_after_forward: Optional[bool] = None
    """Free a unit's gathered parameters after its forward (re-gathered for the backward); None = auto (only when
    there is more than one unit per model and the model is over 2B parameters)."""
    defer_grad_sync: bool = True
    """World size > 1: reduce-scatter gradients once per optimizer step instead of once per micro-batch (micro-batch
    gradients accumulate unsharded on each rank: less communication, one model's worth of gradient memory more)."""
    compile: bool = True
    """GPU: torch.compile each decoder layer's forward (fused elementwise ops, fewer launches); compiling
    costs ~10-20 s in the first steps. false runs eagerly."""
    offload: Any = field(default_factory=list)
    """What to move to host memory during rollout (GPU only): a list of parts, e.g. [params,optimizer]; a single
    name (params) or none also works. Any-typed because a command line gives a list or a plain name."""
    optimizer_on_host: bool = False
    """Keep AdamW's two moments in pinned host memory for the whole run and stream them through the device in chunks
    for each step (DeepSpeed ZeRO-Offload's offload_optimizer, with the update kept on the GPU): 8 bytes per trained
    parameter leave the device (61 GB at 7.6B) for about two passes of them over the host link per step (~2.2 s at
    7.6B and 55 GB/s). The update equals the ordinary step's; `offload`'s optimizer part then has nothing to move."""
    offload_lazy: bool = True
    """With offload: the parts leave the device only when the engine asks for room it does not find, largest first
    (workers/device_room.py); what never left needs no onload. false moves them out at wake-up. Engines that cannot
    say what they allocate (HF native, vLLM, SGLang) always move them out at wake-up."""
    offload_headroom_gb: float = 4.0
    """Lazy offload: GiB kept free beyond what the engine asks for (its weights; its KV cache plus one prefill's
    activations) before the trainer's state may stay on the device: room for what the engine allocates unasked
    (CUDA-graph pools, sampler buffers)."""
    device: str = "auto"
    """auto (cuda if available), cpu or cuda."""
    check_fit: bool = True
    """Before any weights load, estimate each phase's peak device memory (`python -m hybridrl.plan` prints the
    table) and stop with exit code 2, naming the shortfall and settings that fit, if one would not fit."""
    device_memory_gb: Optional[float] = None
    """Device memory (GiB) the fit check plans for; None = what the GPU reports (no check on a CPU device)."""
    seed: int = 0
    """Seed for initialization-time randomness and sampling seeds (per rank and step)."""
    save_every: int = 0
    """Save a checkpoint every N steps (0 = never)."""
    save_final: bool = True
    """Save a checkpoint after the last step (checkpoints/step_N: what python -m hybridrl.export and
    python -m hybridrl.evaluate take, and what a longer run resumes from)."""
    eval_every: int = 0
    """Run validation every N steps (0 = never)."""
    eval_samples: int = 0
    """Validation also samples this many answers per held-out prompt (rollout temperature): val/pass@k, val/mean@k."""
    keep_last: int = 2
    """Checkpoints kept on disk (older ones are deleted once a newer one is complete)."""
    resume: Optional[str] = None
    """auto = continue from the newest complete checkpoint in the run dir; or a checkpoint folder path."""

    def offload_parts(self) -> set[str]:
        """The parts named by `offload`."""
        return set(parse_offload(self.offload))

    def update_batching(self) -> Batching:
        """How the update's passes split a rank's rows."""
        return Batching(self.micro_batch_size, self.max_tokens_per_micro_batch, self.padding_free)

    def logprob_batching(self) -> Batching:
        """How the no-grad log-prob passes (actor and reference) split a rank's rows."""
        budget = self.logprob_max_tokens_per_micro_batch or self.max_tokens_per_micro_batch
        return Batching(self.micro_batch_size, budget, self.padding_free)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"trainer.steps must be >= 1, got {self.steps}")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ConfigError(f"trainer.lr must be a finite number > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"trainer.betas must be two numbers in [0, 1), got {list(self.betas)}")
        # AdamW refuses these itself, but deep in the first worker's start-up and without naming the key.
        if not math.isfinite(self.eps) or self.eps < 0:
            raise ConfigError(f"trainer.eps must be a finite number >= 0 (AdamW's epsilon, e.g. 1e-8), got {self.eps}")
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise ConfigError(f"trainer.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if not math.isfinite(self.grad_clip):
            raise ConfigError(
                f"trainer.grad_clip must be a finite number (<= 0 disables clipping), got {self.grad_clip}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"trainer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if (
            not math.isfinite(self.max_param_norm_ratio)
            or (0 < self.max_param_norm_ratio <= 1)
            or (self.max_param_norm_ratio < 0)
        ):
            raise ConfigError(
                f"trainer.max_param_norm_ratio must be > 1 (or 0 to turn the divergence guard off), got "
                f"{self.max_param_norm_ratio}"
            )
        if self.lr_schedule not in ("constant", "cosine"):
            raise ConfigError(f"trainer.lr_schedule must be constant or cosine, got {self.lr_schedule!r}")
        if not math.isfinite(self.offload_headroom_gb) or self.offload_headroom_gb < 0:
            raise ConfigError(
                f"trainer.offload_headroom_gb must be a finite number >= 0, got {self.offload_headroom_gb}"
            )
        if self.packed_attention not in PACKED_ATTENTION:
            raise ConfigError(
                f"trainer.packed_attention must be one of {', '.join(PACKED_ATTENTION)}, got {self.packed_attention!r}"
            )
        self._check_sequence_parallel()
        if self.device_memory_gb is not None and not self.device_memory_gb > 0:
            raise ConfigError(
                f"trainer.device_memory_gb must be > 0 (or null: the device's own), got {self.device_memory_gb}"
            )
        if self.micro_batch_size < 1:
            raise ConfigError(f"trainer.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.mini_batch_size < 0:
            raise ConfigError(f"trainer.mini_batch_size must be >= 0, got {self.mini_batch_size}")
        if self.ppo_epochs < 1:
            raise ConfigError(f"trainer.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        if self.param_dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"trainer.param_dtype must be auto, float32 or bfloat16, got {self.param_dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"trainer.device must be auto, cpu or cuda, got {self.device!r}")
        self.offload = parse_offload(self.offload)
        if not isinstance(self.optimizer_on_host, bool):
            raise ConfigError(f"trainer.optimizer_on_host must be true or false, got {self.optimizer_on_host!r}")
        for key in (
            "save_every",
            "eval_every",
            "warmup_steps",
            "logprob_chunk_size",
            "eval_samples",
            "max_nonfinite_steps",
            "fsdp_layers_per_unit",
            "max_tokens_per_micro_batch",
            "logprob_max_tokens_per_micro_batch",
        ):
            if getattr(self, key) < 0:
                raise ConfigError(f"trainer.{key} must be >= 0, got {getattr(self, key)}")
        if self.keep_last < 1:
            raise ConfigError(f"trainer.keep_last must be >= 1, got {self.keep_last}")

    def _check_sequence_parallel(self) -> None:
        """Sequence parallelism splits packed rows and runs the varlen attention between its all-to-alls."""
        sp = self.sequence_parallel_size
        if sp < 1:
            raise ConfigError(f"trainer.sequence_parallel_size must be >= 1, got {sp}")
        if sp == 1:
            return
        if not self.padding_free:
            raise ConfigError(
                f"trainer.sequence_parallel_size={sp} splits packed micro-batches; it needs trainer.padding_free=true"
            )
        if self.packed_attention == "model":
            raise ConfigError(
                f"trainer.sequence_parallel_size={sp} runs the varlen attention between its all-to-alls; "
                "set trainer.packed_attention=varlen (or auto)"
            )


@dataclass
class ReferenceConfig:
    """The frozen reference policy (`ref.*`), loaded when the KL to it is used (`algorithm.kl_coef` > 0)."""

    offload: Optional[bool] = None
    """Move its parameters to host memory between its log-prob passes (GPU only); None follows whether
    `trainer.offload` includes params."""

    def resolve_offload(self, trainer: TrainerConfig) -> bool:
        """The offload policy in effect."""
        return "params" in trainer.offload_parts() if self.offload is None else self.offload
