"""The Hydra app: compose the config, validate it, run the controller in Hydra's run dir.

    python -m hybridrl engine=vllm algorithm=grpo trainer.lr=1e-6 logger=wandb
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hybridrl.config import register_configs, validate
from hybridrl.errors import HybridRLError

log = logging.getLogger("hybridrl")

register_configs()


def swept_keys(sweep_dir: str) -> set[str]:
    """Keys the sweep varies (`trainer.lr=1e-5,3e-5`, `range(...)`, ...), read from its multirun.yaml."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    path = Path(sweep_dir) / "multirun.yaml"
    if not path.exists():
        return set()
    overrides = OmegaConf.load(path).hydra.overrides.task
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return {o.key_or_group for o in parsed if o.is_sweep_override()}


def _names(hc) -> tuple[str, str | None]:
    """Job name and the sweep's group name (None for a single run).

    Under -m the job is named by the values of the swept keys only (`trainer.lr=3e-05`), and the
    group by the sweep folder (`2026-11-29_10-54-25`), so wandb groups one sweep's runs together.
    """
    if hc.mode == RunMode.MULTIRUN:
        sweep = Path(hc.sweep.dir)
        group = f"{sweep.parent.name}_{sweep.name}" if sweep.parent.name else sweep.name
        keys = swept_keys(hc.sweep.dir)
        mine = [o for o in hc.overrides.task if o.split("=", 1)[0].lstrip("+~") in keys]
        return ",".join(mine) or hc.job.override_dirname or f"job{hc.job.num}", group
    return Path(hc.runtime.output_dir).name, None


def run(cfg: DictConfig) -> float:
    """Validate `cfg` and train; user errors end the process with one line and a non-zero code.

    Returns the run's objective for sweepers (Optuna): the mean reward/mean over the last 20% of steps.
    """
    import hybridrl.data.synthetic  # noqa: F401  (registers the "synthetic" reward)
    from hybridrl.controller import Controller

    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    try:
        rc = validate(cfg)
        job_name, sweep_group = _names(hc)
        controller = Controller(rc, run_dir, OmegaConf.to_container(cfg, resolve=True), job_name, sweep_group)
        try:
            controller.setup()
            controller.train()
            objective = controller.objective()
        finally:
            controller.cleanup()
    except HybridRLError as e:
        log.error("error: %s", e)
        sys.stderr.flush()
        sys.exit(2)
    except KeyboardInterrupt:
        log.error("interrupted")  # cleanup (workers stopped) already ran in the finally above
        sys.exit(130)
    log.info("done: outputs in %s (objective %.4f)", os.path.relpath(run_dir), objective)
    return objective


@hydra.main(version_base="1.3", config_path="pkg://hybridrl.conf", config_name="config")
def _hydra_entry(cfg: DictConfig) -> float:
    return run(cfg)


def main() -> None:
    """Console-script entry point (`hybridrl ...`), same as `python -m hybridrl ...`."""
    _hydra_entry()
