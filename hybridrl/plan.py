"""Will this run fit its devices? Each phase's peak device memory, estimated before any weights load.

    python -m hybridrl.plan model=hf model.path=/models/Qwen2.5-7B-Instruct data.train_batch_size=16 \\
        engine.max_new_tokens=256 trainer.device=cuda trainer.device_memory_gb=139.8

takes the run's own overrides and prints the table (per phase: parameters, gradients, optimizer state, activations
at the micro-batch's tokens, logits, engine, other roles) and the verdict, exit code 0 if it fits and 2 if not. The
model's size comes from its config.json alone (a 7B plan needs no weights). A run makes the same estimate first
(`trainer.check_fit`) and stops with one line saying by how much it is short and which settings would fit; after each
step `memory/estimate_gb/<phase>` sits beside the measured `memory/<phase>/peak_allocated_gb` (and their ratio,
`memory/estimate_ratio/<phase>`). The device size is `trainer.device_memory_gb` when set (a plan for a GPU from any
machine: add trainer.device=cuda), else what the GPU reports; a CPU run is not checked.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass

from hybridrl.config import RunConfig
from hybridrl.errors import HybridRLError
from hybridrl.training.memory_estimate import (
    PARTS,
    EngineMemory,
    GiB,
    MemoryInputs,
    ModelDims,
    estimate_phases,
    host_bytes,
    logits_path,
    nograd_bytes_per_token,
    peak,
)

log = logging.getLogger("hybridrl")

#: Device memory a run cannot plan on: the CUDA context, the allocator's fragmentation, NCCL's buffers.
RESERVE_FRACTION, RESERVE_MIN = 0.05, 1.0 * GiB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class FitError(HybridRLError):
    """The run's estimated peak device memory exceeds the device."""


def model_dims(model_path: str, trust_remote_code: bool = False) -> ModelDims:
    """The model's dimensions from config.json, its parameter count from a skeleton on the meta device (no weights)."""
    import torch

    from hybridrl.models.loading import load_hf_config
    from hybridrl.models.vision import checkpoint_name, is_vision_param, model_class

    config = load_hf_config(model_path, trust_remote_code)
    with torch.device("meta"):
        skeleton = model_class(config).from_config(config, trust_remote_code=trust_remote_code)
    text = config.get_text_config()
    named = list(skeleton.named_parameters())
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelDims(
        params=sum(p.numel() for _, p in named),
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        q_dim=heads * head_dim,
        kv_dim=(getattr(text, "num_key_value_heads", None) or heads) * head_dim,
        intermediate=text.intermediate_size,
        vocab=text.vocab_size,
        tied=bool(getattr(text, "tie_word_embeddings", False)),
        vision=sum(p.numel() for n, p in named if is_vision_param(checkpoint_name(n))),
    )


def lora_params(model_path: str, trust_remote_code: bool, rank: int, targets: list[str]) -> int:
    """Adapter parameters of LoRA at `rank` on the decoder's linear layers named `targets`: rank × (in + out) each."""
    import torch

    from hybridrl.models.loading import load_hf_config
    from hybridrl.models.vision import model_class
    from hybridrl.training.fsdp import decoder_layers

    config = load_hf_config(model_path, trust_remote_code)
    with torch.device("meta"):
        skeleton = model_class(config).from_config(config, trust_remote_code=trust_remote_code)
    return sum(
        rank * (m.in_features + m.out_features)
        for layer in decoder_layers(skeleton)
        for name, m in layer.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
    )


def device_memory_bytes(cfg: RunConfig) -> float | None:
    """The device size to plan for: trainer.device_memory_gb, else the smallest visible GPU's (asked of nvidia-smi,
    so the controller makes no CUDA context), else None (a CPU run, or no GPU to ask)."""
    if cfg.trainer.device_memory_gb is not None:
        return cfg.trainer.device_memory_gb * GiB
    if not plans_for_gpu(cfg):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    totals = [float(x) * 2**20 for x in out if x.replace(".", "", 1).isdigit()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and all(v.strip().isdigit() for v in visible.split(",")):
        totals = [totals[int(v)] for v in visible.split(",") if int(v) < len(totals)]
    return min(totals) if totals else None


def plans_for_gpu(cfg: RunConfig) -> bool:
    """Whether the run computes on a GPU (or is planned for one from any machine: trainer.device=cuda)."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device == "cuda"
    import torch

    return torch.cuda.is_available()


def longest_sequence(cfg: RunConfig) -> int:
    """The most tokens one sample can hold."""
    if cfg.rollout.name == "agent":
        return cfg.agent.max_total_tokens
    return cfg.data.max_prompt_tokens + cfg.engine.max_new_tokens


def micro_batch_tokens(cfg: RunConfig, budget: int, rows: int) -> int:
    """Tokens of the largest micro-batch one data-parallel rank runs: the budget (per device: times the
    sequence-parallel degree, whose ranks share the micro-batch; never less than one sequence), or `rows` sequences
    at the longest; never more than the rank's share of a mini-batch."""
    longest = longest_sequence(cfg)
    sp = cfg.trainer.sequence_parallel_size
    dp = cfg.cluster.world_size // sp
    per_rank = cfg.data.train_batch_size * cfg.algorithm.group_size // dp
    if cfg.trainer.mini_batch_size:
        per_rank = max(1, cfg.trainer.mini_batch_size // dp)
    most = per_rank * longest
    return min(most, max(budget * sp, longest)) if budget else min(most, rows * longest)


def engine_memory(cfg: RunConfig, dims: ModelDims, gpu: bool, device_bytes: float | None) -> EngineMemory:
    """The engine's weights (split over engine.tp_size), KV cache and workspace while it is awake."""
    e, tp = cfg.engine, cfg.engine.tp_size
    b = DTYPE_BYTES.get(e.dtype, 2 if gpu else 4)
    weights = b * dims.params / tp
    replicas = cfg.cluster.world_size // tp
    groups = cfg.data.train_batch_size
    if cfg.rollout.partial.enabled:  # the over-sampled groups are in flight too
        groups += cfg.rollout.partial.extra_groups(groups)
    seqs = max(1, groups // max(1, replicas)) * cfg.algorithm.group_size
    longest = longest_sequence(cfg)
    per_token_kv = dims.kv_bytes_per_token(b) / tp
    if e.name == "vllm" and gpu and device_bytes and not e.vllm.kv_cache_memory_gb:
        return EngineMemory(weights, max(0.0, e.vllm.gpu_memory_utilization * device_bytes - weights), 0.0)
    if e.name == "sglang" and device_bytes:
        return EngineMemory(weights, max(0.0, e.sglang.mem_fraction_static * device_bytes - weights), 0.0)
    if e.name == "vllm":
        return EngineMemory(weights, e.vllm.kv_cache_memory_gb * GiB, 0.0)
    n = e.native
    rows = min(n.max_batch_size, seqs)
    if n.kv_blocks:
        kv = n.kv_blocks * n.kv_block_size * per_token_kv
    elif n.kv_memory_fraction and device_bytes:
        kv = n.kv_memory_fraction * device_bytes
    else:  # by demand: every running row at the longest request
        kv = rows * longest * per_token_kv
    prefill = min(n.prefill_tokens, rows * longest)
    workspace = prefill * nograd_bytes_per_token(dims, b) / tp + rows * dims.vocab * 4
    return EngineMemory(weights, kv, workspace)


def memory_inputs(cfg: RunConfig, dims: ModelDims | None = None, device_bytes: float | None = None) -> MemoryInputs:
    """What the estimate reads, from the run's config."""
    from hybridrl.models.loading import resolve_model_path
    from hybridrl.models.vision import tower_trains
    from hybridrl.training.fsdp import unit_layout, use_compile

    path = resolve_model_path(cfg.model)
    dims = dims or model_dims(path, cfg.model.trust_remote_code)
    t, m, world = cfg.trainer, cfg.model, cfg.cluster.world_size
    gpu = plans_for_gpu(cfg)
    b = 2 if gpu and t.param_dtype != "float32" else 4
    lora = lora_params(path, m.trust_remote_code, m.lora.rank, list(m.lora.target_modules)) if m.lora.enabled else 0
    sharded = lora if lora and world == 1 else dims.params  # one rank with LoRA: FSDP holds the adapters alone
    per_unit, reshard = unit_layout(dims.layers, sharded, t.fsdp_layers_per_unit, t.reshard_after_forward)
    # The root unit: embeddings, the head, and a vision tower (`shard_model` wraps only decoder layers).
    root = (dims.vocab * dims.hidden * (1 if dims.tied else 2) + dims.vision) / dims.params
    gathered = 1.0 if per_unit >= dims.layers else min(1.0, 2 * per_unit / dims.layers + root)
    logprob_budget = t.logprob_max_tokens_per_micro_batch or t.max_tokens_per_micro_batch
    critic_budget = cfg.critic.micro_batching(t).max_tokens
    critic_rows = cfg.critic.batching(t)[1]
    critic_offload = cfg.critic.offload_parts(t)
    return MemoryInputs(
        dims=dims,
        world=world,
        compute_bytes=b,
        update_tokens=micro_batch_tokens(cfg, t.max_tokens_per_micro_batch, t.micro_batch_size),
        logprob_tokens=micro_batch_tokens(cfg, logprob_budget, t.micro_batch_size),
        kept_fraction=cfg.engine.max_new_tokens / longest_sequence(cfg) if cfg.rollout.name != "agent" else 1.0,
        engine=engine_memory(cfg, dims, gpu, device_bytes),
        lora_params=lora,
        frozen_params=0 if m.lora.enabled or tower_trains(m) else dims.vision,
        checkpointing=m.gradient_checkpointing,
        compiled=gpu and use_compile(t.compile, m.gradient_checkpointing, _device("cuda")),
        logits_path=logits_path(t.logprob_chunk_size, gpu and t.fused_logprobs),
        chunk=t.logprob_chunk_size,
        gathered_fraction=gathered,
        reshard_after_forward=reshard,
        offload=frozenset(t.offload_parts()) if gpu else frozenset(),
        ref=cfg.algorithm.uses_reference and not m.lora.enabled,
        ref_offload=gpu and cfg.ref.resolve_offload(t),
        critic=cfg.algorithm.needs_critic,
        critic_offload=frozenset(critic_offload) if gpu else frozenset(),
        critic_tokens=micro_batch_tokens(cfg, critic_budget, critic_rows),
        engine_awake_in_training=cfg.engine.sleep_level == 0,
        sequence_parallel=t.sequence_parallel_size,
        optimizer_on_host=t.optimizer_on_host,
        critic_optimizer_on_host=cfg.critic.resolve_optimizer_on_host(t),
    )


def _device(kind: str):
    import torch

    return torch.device(kind)


@dataclass
class Plan:
    """The estimate for one config on one device size."""

    inputs: MemoryInputs
    phases: dict[str, dict[str, float]]
    device_bytes: float | None

    @property
    def usable(self) -> float | None:
        """What the run may plan on: the device less the reserve (context, fragmentation)."""
        if self.device_bytes is None:
            return None
        return self.device_bytes - max(RESERVE_MIN, RESERVE_FRACTION * self.device_bytes)

    @property
    def peak(self) -> tuple[str, float]:
        """(phase, bytes) of the largest estimate."""
        return peak(self.phases)

    @property
    def fits(self) -> bool:
        return self.usable is None or self.peak[1] <= self.usable

    def phase_bytes(self, phase: str) -> float:
        """The estimated peak of one phase, in bytes."""
        return sum(self.phases[phase].values())

    def estimate_gb(self) -> dict[str, float]:
        """GiB per phase: what `memory/estimate_gb/<phase>` logs."""
        return {phase: self.phase_bytes(phase) / GiB for phase in self.phases}

    def table(self) -> str:
        """The estimate as a text table, GiB per part and phase, with the device's usable memory."""
        header = f"{'phase':<14}" + "".join(f"{p:>12}" for p in PARTS) + f"{'total':>12}"
        lines = [header]
        for phase, parts in self.phases.items():
            cells = "".join(f"{parts.get(p, 0.0) / GiB:>12.2f}" for p in PARTS)
            lines.append(f"{phase:<14}{cells}{self.phase_bytes(phase) / GiB:>12.2f}")
        if self.usable is not None:
            lines.append(f"device {self.device_bytes / GiB:.1f} GiB, usable {self.usable / GiB:.1f} GiB")
        host = host_bytes(self.inputs)
        if host:
            parts = ", ".join(f"{k.replace('_', ' ')} {v / GiB:.2f}" for k, v in host.items())
            lines.append(f"host memory (pinned, per rank): {sum(host.values()) / GiB:.2f} GiB ({parts})")
        return "\n".join(lines)


def make_plan(cfg: RunConfig, device_bytes: float | None = None, dims: ModelDims | None = None) -> Plan:
    """The estimate of `cfg` for a device of `device_bytes` (None: no verdict)."""
    inputs = memory_inputs(cfg, dims, device_bytes)
    return Plan(inputs, estimate_phases(inputs), device_bytes)


def levers(cfg: RunConfig, inp: MemoryInputs) -> list[tuple[str, dict]]:
    """The settings the estimate can turn, least intrusive first: (overrides, changes to the estimate's inputs)."""
    from hybridrl.models.loading import resolve_model_path

    both = frozenset({"params", "optimizer"})
    out: list[tuple[str, dict]] = []
    if inp.ref and not inp.ref_offload:  # the reference alone to host memory between its passes: the least host room
        out.append(("ref.offload=true", {"ref_offload": True}))
    if inp.offload != both or (inp.ref and not inp.ref_offload):
        changes = {"offload": both, "ref_offload": inp.ref, "critic_offload": both if inp.critic else frozenset()}
        out.append(("trainer.offload=[params,optimizer]", changes))
    if not inp.checkpointing:
        out.append(("model.gradient_checkpointing=true", {"checkpointing": True, "compiled": False}))
    if not inp.optimizer_on_host or (inp.critic and not inp.critic_optimizer_on_host):
        out.append(("trainer.optimizer_on_host=true", {"optimizer_on_host": True, "critic_optimizer_on_host": True}))
    if not cfg.model.lora.enabled:
        path = resolve_model_path(cfg.model)
        lora = lora_params(path, cfg.model.trust_remote_code, LORA_RANK, list(cfg.model.lora.target_modules))
        out.append((f"model.lora.rank={LORA_RANK}", {"lora_params": lora, "ref": False, "ref_offload": False}))
    for n in (2, 4, 8):
        out.append((f"{inp.world * n} devices (cluster.workers_per_node, cluster.nnodes)", {"world": inp.world * n}))
    return out


#: The adapter rank proposed when LoRA would fit (verl's and OpenRLHF's examples use 32-64).
LORA_RANK = 64


def alternatives(cfg: RunConfig, plan: Plan, most: int = 3) -> list[tuple[str, float]]:
    """Settings that fit where `plan` does not: (overrides, estimated peak GiB). Each combination of up to three
    levers (`levers`) is tried as it is and with the largest token budget that then fits. The answer leads with the
    fewest changes that keep the model fully trained on these devices, then with LoRA, then with more devices (one
    of each where one fits; among as many changes the one with the most room left), and fills up with the next."""
    from itertools import combinations

    inp, usable = plan.inputs, plan.usable
    if usable is None:
        return []
    options = levers(cfg, inp)
    found: list[tuple[int, int, float, str]] = []  # (kind, changes, bytes, overrides)
    for size in (1, 2, 3):
        for combo in combinations(options, size):
            names = [name for name, _ in combo]
            if sum("devices" in name for name in names) > 1:
                continue
            trial = inp.with_(**{k: v for _, c in combo for k, v in c.items()})
            need = peak(estimate_phases(trial))[1]
            if need > usable:
                budget = _largest_budget(cfg, trial, usable)
                if not budget:
                    continue
                trial = trial.with_(**_budget_changes(trial, budget))
                need = peak(estimate_phases(trial))[1]
                names.append(f"trainer.max_tokens_per_micro_batch={budget}")
            kind = 2 if any("devices" in n for n in names) else 1 if any("lora" in n for n in names) else 0
            found.append((kind, len(names), need, " ".join(names)))
    found.sort(key=lambda f: (f[1], f[2]))  # fewest changes; among as many, the most room left
    firsts = [next(f for f in found if f[0] == kind) for kind in (0, 1, 2) if any(f[0] == kind for f in found)]
    rest = [f for f in found if f not in firsts]
    return [(name, need / GiB) for _, _, need, name in (firsts + rest)[:most]]


def _budget_changes(inp: MemoryInputs, budget: int) -> dict:
    return {"update_tokens": min(inp.update_tokens, budget), "logprob_tokens": min(inp.logprob_tokens, budget)}


def _largest_budget(cfg: RunConfig, inp: MemoryInputs, usable: float) -> int:
    """The largest token budget (a multiple of 256, at least one longest sequence, below today's micro-batch) with
    which every phase fits; 0 if none."""
    longest = longest_sequence(cfg)
    hi = inp.update_tokens
    candidates = [n for n in range(256 * (hi // 256), longest - 1, -256) if n < hi] + [longest]
    for n in candidates:
        if peak(estimate_phases(inp.with_(**_budget_changes(inp, n))))[1] <= usable:
            return n
    return 0


def shortfall_line(cfg: RunConfig, plan: Plan) -> str:
    """One line: which phase needs how much of how much, and which settings fit instead."""
    phase, need = plan.peak
    line = (
        f"the run needs about {need / GiB:.2f} GiB of device memory in its {phase} phase, "
        f"{(need - plan.usable) / GiB:.2f} GiB more than the {plan.usable / GiB:.2f} GiB usable of the "
        f"{plan.device_bytes / GiB:.2f} GiB device"
    )
    options = alternatives(cfg, plan)
    if options:
        line += "; these fit: " + " | ".join(f"{name} ({gb:.2f} GiB)" for name, gb in options)
    else:
        line += "; no single setting here fits it"
    return line + " (python -m hybridrl.plan <overrides> prints each phase; trainer.check_fit=false runs anyway)"


def check_fit(cfg: RunConfig) -> Plan | None:
    """Raise FitError (exit code 2) when the estimate exceeds the device; the plan, or None when nothing is checked
    (trainer.check_fit=false, or no device size known)."""
    if not cfg.trainer.check_fit:
        return None
    device = device_memory_bytes(cfg)
    if device is None:
        return None
    plan = make_plan(cfg, device)
    if not plan.fits:
        raise FitError(shortfall_line(cfg, plan))
    log.info("memory plan: peak %.1f GiB in %s of %.1f GiB usable", plan.peak[1] / GiB, plan.peak[0], plan.usable / GiB)
    return plan


def estimate_report(estimate_gb: dict[str, float], measured: dict[str, dict[str, float]]) -> dict[str, dict]:
    """`memory/estimate_gb/<phase>` and, where the device measured a peak, `memory/estimate_ratio/<phase>` (measured
    peak / estimate): the worker's memory report adds these. The estimate is what a phase needs, so trainer state
    that lazy offload left on the device only because there was room (`lazily_kept_gb`) is taken out of the peak."""
    out: dict[str, dict] = {"estimate_gb": dict(estimate_gb)}
    ratios = {
        p: (measured[p]["peak_allocated_gb"] - measured[p].get("lazily_kept_gb", 0.0)) / gb
        for p, gb in estimate_gb.items()
        if gb > 0 and "peak_allocated_gb" in measured.get(p, {})
    }
    if ratios:
        out["estimate_ratio"] = ratios
    return out


def main(argv: list[str] | None = None) -> int:
    """Compose the config from `argv` (the run's overrides), print the table and the verdict."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from hybridrl.cli import help_text, wants_help
    from hybridrl.config import register_configs, validate
    from hybridrl.config_checks import composition_error_line

    args = sys.argv[1:] if argv is None else argv
    if wants_help(args):
        print(help_text("hybridrl.plan"))
        return 0
    register_configs()
    try:
        with initialize_config_module(config_module="hybridrl.conf", version_base="1.3"):
            cfg = validate(compose(config_name="config", overrides=args))
        device = device_memory_bytes(cfg)
        plan = make_plan(cfg, device)
    except HybridRLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (HydraException, OmegaConfBaseException) as e:  # an unknown key or group: one line, as the app says it
        print(f"error: {composition_error_line(e)}", file=sys.stderr)
        return 2
    print(plan.table())
    if plan.device_bytes is None:
        print("no device size known: set trainer.device_memory_gb (and trainer.device=cuda) for a verdict")
        return 0
    if plan.fits:
        phase, need = plan.peak
        print(f"fits: peak {need / GiB:.1f} GiB in {phase}, {(plan.usable - need) / GiB:.1f} GiB to spare")
        return 0
    print(f"error: {shortfall_line(cfg, plan)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
