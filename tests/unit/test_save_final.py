"""trainer.save_final: on by default, and a resumed run may turn it off (bookkeeping, not the experiment)."""

from __future__ import annotations

from omegaconf import OmegaConf

from hybridrl.config import RunConfig
from hybridrl.resume_policy import resume_config_diff


def test_on_by_default_and_changeable_on_resume():
    saved = OmegaConf.to_container(OmegaConf.structured(RunConfig))
    assert saved["trainer"]["save_final"] is True
    now = OmegaConf.structured(RunConfig)
    now.trainer.save_final = False
    assert resume_config_diff(saved, OmegaConf.to_container(now)) == (["trainer.save_final"], [])
