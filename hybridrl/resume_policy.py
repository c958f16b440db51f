"""Which config keys may differ between a checkpoint's run and the run that resumes it.

A resumed run continues one experiment: its model, data order, algorithm, sampling and world layout
must be the checkpoint's, or the restored optimizer state, data position and RNG streams would mean
something else. Schedule and bookkeeping knobs (`trainer.steps`, `trainer.lr`, how often to save or
evaluate, logging, timeouts) and knobs that only change speed or memory may change; the new values
apply and one log line lists them. The policy is the table `RULES` below, first match wins; a key no
rule names is refused, so a new config key is frozen on resume until someone decides otherwise.

The controller's use, at resume::

    applied, refused = resume_config_diff(read_meta(path)["config"], full_config, defaults)
    # refused -> ConfigError naming the keys; applied -> one log line (`describe_changes`)
    # or in one call:  line = enforce_resume_policy(saved, current, defaults)
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from hybridrl.errors import ConfigError

APPLY, REFUSE = "apply", "refuse"

#: (key pattern, decision, why) — fnmatch patterns over dotted keys; the first matching rule decides.
RULES: tuple[tuple[str, str, str], ...] = (
    # The run's length, bookkeeping and the learning-rate schedule: the new values take effect.
    ("trainer.steps", APPLY, "run length"),
    ("trainer.resume", APPLY, "how this run starts"),
    ("trainer.save_every", APPLY, "checkpoint cadence"),
    ("trainer.save_final", APPLY, "checkpoint cadence"),
    ("trainer.keep_last", APPLY, "checkpoint retention"),
    ("trainer.eval_every", APPLY, "validation cadence"),
    ("trainer.eval_samples", APPLY, "validation sampling"),
    ("trainer.lr", APPLY, "peak learning rate (applied to the restored optimizer and schedule)"),
    ("trainer.warmup_steps", APPLY, "schedule shape (the schedule is rebuilt from the config)"),
    ("trainer.lr_schedule", APPLY, "schedule shape (the schedule is rebuilt from the config)"),
    ("trainer.min_lr_ratio", APPLY, "schedule shape (the schedule is rebuilt from the config)"),
    ("trainer.grad_clip", APPLY, "read at every optimizer step"),
    ("trainer.max_nonfinite_steps", APPLY, "failure tolerance"),
    ("trainer.max_param_norm_ratio", APPLY, "failure detection (the divergence guard)"),
    # Speed and memory only: same math.
    ("trainer.micro_batch_size", APPLY, "gradient accumulation split only"),
    ("trainer.max_tokens_per_micro_batch", APPLY, "gradient accumulation split only"),
    ("trainer.logprob_max_tokens_per_micro_batch", APPLY, "speed and memory only"),
    ("trainer.padding_free", APPLY, "input layout only: the same log-probs and gradients"),
    ("trainer.packed_attention", APPLY, "kernel choice"),
    (
        "trainer.sequence_parallel_size",
        APPLY,
        "how each sequence is split over ranks: the same log-probs and gradients",
    ),
    ("trainer.check_fit", APPLY, "a check before any weights load"),
    ("trainer.device_memory_gb", APPLY, "the fit check's device size"),
    ("critic.max_tokens_per_micro_batch", APPLY, "gradient accumulation split only"),
    ("trainer.logprob_chunk_size", APPLY, "memory only"),
    ("trainer.fused_logprobs", APPLY, "kernel choice"),
    ("trainer.fused_optimizer", APPLY, "kernel choice"),
    ("trainer.compile", APPLY, "kernel choice"),
    ("trainer.offload", APPLY, "memory only"),
    ("trainer.offload_lazy", APPLY, "memory only"),
    ("trainer.offload_headroom_gb", APPLY, "memory only"),
    ("trainer.optimizer_on_host", APPLY, "memory only (the moments are saved and loaded the same)"),
    ("trainer.fsdp_layers_per_unit", APPLY, "sharding granularity: speed and memory only"),
    ("trainer.reshard_after_forward", APPLY, "speed and memory only"),
    ("trainer.defer_grad_sync", APPLY, "when gradients are reduced, not what they sum to"),
    ("ref.offload", APPLY, "memory only"),
    ("critic.offload", APPLY, "memory only"),
    ("critic.optimizer_on_host", APPLY, "memory only (the moments are saved and loaded the same)"),
    ("critic.micro_batch_size", APPLY, "gradient accumulation split only"),
    ("trainer.param_dtype", APPLY, "compute precision"),
    ("trainer.device", APPLY, "where it runs"),
    ("model.attn_implementation", APPLY, "kernel choice"),
    ("model.gradient_checkpointing", APPLY, "memory only"),
    ("model.cache_dir", APPLY, "where the tiny model is cached"),
    ("model.trust_remote_code", APPLY, "a permission, not the model"),
    ("engine.name", APPLY, "engine implementation (same sampling)"),
    ("engine.dtype", APPLY, "engine precision"),
    ("engine.sleep_level", APPLY, "memory only"),
    ("engine.max_batch_size", APPLY, "speed and memory only"),
    ("engine.impl", APPLY, "engine implementation"),
    ("engine.cuda_graphs", APPLY, "speed only"),
    ("engine.sampler_kernel", APPLY, "kernel choice"),
    ("engine.max_model_len", APPLY, "engine bookkeeping"),
    ("engine.prefill_tokens", APPLY, "speed and memory only"),
    ("engine.native.*", APPLY, "engine implementation"),
    ("engine.vllm.*", APPLY, "engine implementation"),
    ("engine.sglang.*", APPLY, "engine implementation"),
    ("reshard.*", APPLY, "weight sync mechanics"),
    ("logger.*", APPLY, "logging"),
    ("cluster.collective_timeout_s", APPLY, "failure detection"),
    ("cluster.cpu_threads", APPLY, "speed only"),
    ("cluster.ray_address", APPLY, "where the cluster is"),
    ("cluster.name", APPLY, "process launcher (the world size is checked separately)"),
    ("reward.max_error_frac", APPLY, "failure tolerance"),
    ("reward.timeout_s", APPLY, "failure handling"),
    ("reward.num_workers", APPLY, "speed only"),
    ("reward.remote.timeout_s", APPLY, "failure handling"),
    ("reward.remote.max_retries", APPLY, "failure handling"),
    ("reward.remote.backoff_s", APPLY, "failure handling"),
    ("agent.tool_timeout_s", APPLY, "failure handling"),
    ("agent.tool_timeouts", APPLY, "failure handling"),
    ("agent.tool_timeouts.*", APPLY, "failure handling"),
    ("agent.max_concurrent_trajectories", APPLY, "speed only"),
    ("agent.max_concurrent_tools", APPLY, "speed only"),
    # The experiment itself.
    ("trainer.seed", REFUSE, "the RNG streams the checkpoint continues"),
    ("trainer.weight_decay", REFUSE, "stored in the checkpoint's optimizer state"),
    ("trainer.betas", REFUSE, "stored in the checkpoint's optimizer state"),
    ("trainer.eps", REFUSE, "stored in the checkpoint's optimizer state"),
    ("trainer.mini_batch_size", REFUSE, "optimizer steps per iteration, which the schedule's position counts"),
    ("trainer.ppo_epochs", REFUSE, "optimizer steps per iteration, which the schedule's position counts"),
    ("model.*", REFUSE, "the model the checkpoint holds"),
    ("data.*", REFUSE, "the prompts and the data position the checkpoint holds"),
    ("algorithm.*", REFUSE, "the algorithm being run"),
    ("reward.*", REFUSE, "the reward being optimized"),
    ("engine.tp_size", REFUSE, "the world layout"),
    ("engine.*", REFUSE, "the sampling distribution (temperature, top-p/k, lengths, stop tokens)"),
    ("cluster.*", REFUSE, "the world layout"),
    ("rollout.*", REFUSE, "how the trajectories being trained on are made"),
    ("critic.*", REFUSE, "the value model and its optimization (stored in the checkpoint's critic/)"),
    ("reward_model.*", REFUSE, "the reward being optimized"),
    ("agent.*", REFUSE, "the tools, turns and budgets of the trajectories being trained on"),
    ("*", REFUSE, "not classified for resume (hybridrl/resume_policy.py RULES)"),
)


def rule_for(key: str) -> tuple[str, str, str]:
    """The first rule whose pattern matches `key`."""
    return next(r for r in RULES if fnmatchcase(key, r[0]))


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values (compared whole)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def changed_keys(saved: dict, current: dict, defaults: dict | None = None) -> dict[str, tuple[Any, Any]]:
    """{key: (saved value, current value)} for every key whose value differs.

    A key only one side has (a checkpoint from an older version, a section added since) is compared
    with its value in `defaults` when given; without defaults it is not a change.
    """
    a, b = flatten(saved or {}), flatten(current or {})
    d = flatten(defaults or {})
    out: dict[str, tuple[Any, Any]] = {}
    for key in sorted(set(a) | set(b)):
        missing = object()
        old, new = a.get(key, missing), b.get(key, missing)
        if old is missing or new is missing:
            if key not in d:
                continue
            old, new = (d[key] if old is missing else old), (d[key] if new is missing else new)
        if old != new:
            out[key] = (old, new)
    return out


def resume_config_diff(saved: dict, current: dict, defaults: dict | None = None) -> tuple[list[str], list[str]]:
    """(applied, refused): the changed keys the policy lets take effect, and those it refuses. Pure."""
    applied, refused = [], []
    for key in changed_keys(saved, current, defaults):
        (applied if rule_for(key)[1] == APPLY else refused).append(key)
    return applied, refused


def describe_changes(saved: dict, current: dict, keys: list[str], defaults: dict | None = None) -> str:
    """`trainer.lr 1e-05 -> 3e-05, trainer.steps 60 -> 120` for `keys`."""
    diff = changed_keys(saved, current, defaults)
    return ", ".join(f"{k} {diff[k][0]!r} -> {diff[k][1]!r}" for k in keys if k in diff)


def enforce_resume_policy(saved: dict, current: dict, defaults: dict | None = None) -> str | None:
    """Raise ConfigError naming every refused key (with why); else the log line of applied changes, or None."""
    applied, refused = resume_config_diff(saved, current, defaults)
    if refused:
        diff = changed_keys(saved, current, defaults)
        parts = [f"{k} ({diff[k][0]!r} -> {diff[k][1]!r}: {rule_for(k)[2]})" for k in refused]
        raise ConfigError(
            "cannot resume with a changed "
            + "; ".join(parts)
            + ". Resume with the checkpoint's values, or start a new run (another hydra.run.dir)"
        )
    if not applied:
        return None
    return "resume: config changes applied: " + describe_changes(saved, current, applied, defaults)
