"""Roles built the way a run builds them (`build_components`), for tests that need one without an engine."""

from __future__ import annotations

import torch

from hybridrl.config import RunConfig
from hybridrl.models.config import ModelConfig
from hybridrl.training.config import TrainerConfig
from hybridrl.workers.build import build_components


def make_actor(model_path: str, **trainer):
    """The actor role on the CPU for the model folder `model_path`, trainer options from `trainer`
    (needs a process group: the `process_group` fixture)."""
    cfg = RunConfig(model=ModelConfig(name="hf", path=model_path), trainer=TrainerConfig(**trainer))
    return build_components(cfg, cfg.topology(), torch.device("cpu"), with_engine=False).actor
