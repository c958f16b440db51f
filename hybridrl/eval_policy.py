"""The policy that `python -m hybridrl.evaluate` and `python -m hybridrl.generate` sample: a model folder, a Hub id or
a run's checkpoint, behind the same worker group and engine a training run uses (so the engine, its sampling and the
reward are exactly training's).

    run_cfg, checkpoint = policy_config(cfg)     # cfg: EvaluateConfig / GenerateConfig (validated)
    with policy_group(run_cfg, checkpoint) as group:
        outs = group.generate(token_ids, step=0, params=sampling(cfg))

A checkpoint is verified against its checksums first (as resume and export do). Its model section (tiny shape,
LoRA) comes from the checkpoint; the model folder it trained from and whether that folder's code may run come from
the command line only (model.path, model.trust_remote_code), never from a checkpoint's metadata.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import OmegaConf

from hybridrl.checkpoints import META, read_meta, verify
from hybridrl.config import RunConfig
from hybridrl.engines.base import SamplingParams
from hybridrl.errors import ConfigError
from hybridrl.eval_config import EvalConfig, EvaluateConfig, GenerateConfig
from hybridrl.models.config import ModelConfig
from hybridrl.phases import Phase
from hybridrl.workers.group import WorkerGroup

log = logging.getLogger("hybridrl")


def _is_checkpoint(path: str | None) -> bool:
    return bool(path) and (Path(os.path.expanduser(path)) / META).is_file()


def checkpoint_model(meta: dict, user: ModelConfig, checkpoint: str) -> ModelConfig:
    """The checkpoint's model section, with the model folder and the remote-code switch the user gave."""
    saved = dict((meta.get("config") or {}).get("model") or {})
    if saved.get("path") and not user.path:
        raise ConfigError(
            f"{checkpoint} was trained from model.path={saved['path']!r}; pass that model too: "
            f"eval.checkpoint={checkpoint} model.path={saved['path']} (the model folder is never taken from a "
            "checkpoint's metadata)"
        )
    if saved.get("trust_remote_code") and not user.trust_remote_code:
        raise ConfigError(
            f"{checkpoint} was trained with model.trust_remote_code=true; set it if you trust the code in the model "
            "folder (it is never enabled from a checkpoint's metadata)"
        )
    saved.update(path=user.path, trust_remote_code=user.trust_remote_code, cache_dir=user.cache_dir)
    saved["name"] = "hf" if user.path else "tiny"
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved))


def policy_config(cfg: EvaluateConfig | GenerateConfig) -> tuple[RunConfig, Path | None]:
    """The run config the workers are built from, and the verified checkpoint to load (None for a model folder).

    `model.path` naming a checkpoint folder counts as `eval.checkpoint`. Nothing trains, so no reference model is
    loaded; the sampling seed is `eval.seed`."""
    ev: EvalConfig = cfg.eval
    model, checkpoint = cfg.model, ev.checkpoint
    key = "eval.checkpoint"
    if checkpoint is None and _is_checkpoint(model.path):
        checkpoint, key, model = model.path, "model.path", dataclasses.replace(model, path=None, name="tiny")
    path = None
    if checkpoint:
        path = Path(os.path.expanduser(checkpoint))
        if not (path / META).is_file():
            raise ConfigError(f"{key}={checkpoint!r} is not a complete checkpoint folder (no {META})")
        verify(path)
        model = checkpoint_model(read_meta(path), model, str(checkpoint))
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(RunConfig)}
    sections.update(
        model=model,
        algorithm=dataclasses.replace(cfg.algorithm, kl_coef=0.0),  # no KL term: no reference model to load
        trainer=dataclasses.replace(cfg.trainer, seed=ev.seed),
    )
    return RunConfig(**sections), path


def sampling(cfg: EvaluateConfig | GenerateConfig) -> SamplingParams:
    """`eval.*` as the engines' sampling parameters (max_new_tokens defaults to engine.max_new_tokens)."""
    ev: EvalConfig = cfg.eval
    return SamplingParams(
        n=ev.n,
        temperature=ev.temperature,
        top_p=ev.top_p,
        top_k=ev.top_k,
        max_new_tokens=ev.max_new_tokens or cfg.engine.max_new_tokens,
        stop_token_ids=list(cfg.engine.stop_token_ids),
    )


@contextmanager
def policy_group(run_cfg: RunConfig, checkpoint: Path | None) -> Iterator[WorkerGroup]:
    """The run's worker group with the checkpoint's weights in trainer and engine, awake for generation."""
    from hybridrl.workers.backends import build_worker_group

    group = build_worker_group(run_cfg)
    try:
        if checkpoint is not None:
            group.run_all(Phase.LOAD_CHECKPOINT, str(checkpoint))
            group.run_all(Phase.RESHARD)
            log.info("loaded %s", checkpoint)
        group.run_all(Phase.WAKE)
        yield group
    finally:
        group.shutdown()
