"""The Hydra app: compose the config, validate it, run the controller in Hydra's run dir.

    python -m hybridrl engine=vllm algorithm=grpo trainer.lr=1e-6 logger=wandb

Every way a run can end badly ends with one line on the console: a user error (HybridRLError: the
config, a file, the data, a run dir another run holds, a full disk at a save) with exit code 2; a composition error
(unknown key, missing option, moved key) with 2; Ctrl-C with 130; SIGTERM (a scheduler, `kill`) with 143; anything
unexpected with 1, naming the phase, the exception and where its full traceback is (`hybridrl.log` in the run dir).
An error during a training step names the step. HYDRA_FULL_ERROR=1 shows Hydra's own tracebacks.

One run writes to a run dir at a time: `hybridrl.run_lock` locks it before Hydra writes into it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hybridrl.config import register_configs, validate
from hybridrl.config_checks import check_composed, composition_error_line, moved_key_in_overrides
from hybridrl.errors import HybridRLError, Terminated, in_phase, phase_of, step_of
from hybridrl.run_lock import RunNotStarted, lock_dir, unlock_dir

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
    """Validate `cfg` and train; every failure ends the process with one line and a non-zero code.

    Returns the run's objective for sweepers (Optuna): the mean reward/mean over the last 20% of steps. The run
    ends with a summary of its figures (`Controller.summary`).
    """
    import hybridrl.agent.tasks  # noqa: F401  (registers the tool task's rewards, calc_exact and calc_shaped)
    import hybridrl.data.synthetic  # noqa: F401  (registers the "synthetic" reward)
    from hybridrl.controller import Controller
    from hybridrl.models.loading import check_supported_architecture, resolve_model_path
    from hybridrl.plan import check_fit

    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    try:
        # A sweep's job (and a run started without the app's callback) locks its own dir here; a plain run's lock
        # was taken by RunDirLockCallback before Hydra wrote anything, and is reused.
        lock_dir(run_dir, "hydra.run.dir" if hc.mode == RunMode.RUN else "hydra.sweep.subdir")
        with in_phase("config"):
            check_composed(cfg)
            rc = validate(cfg)
            rc.data.check_files()
            check_supported_architecture(resolve_model_path(rc.model), rc.model.trust_remote_code)
            check_fit(rc)  # before any weights load: exit 2 naming the shortfall and what fits
        if rc.rollout.name == "agent" and "python" in rc.agent.tools:
            from hybridrl.agent.tools.sandbox import protect_process

            protect_process()  # the controller's environment and memory closed to the code the tool runs
        job_name, sweep_group = _names(hc)
        controller = Controller(rc, run_dir, OmegaConf.to_container(cfg, resolve=True), job_name, sweep_group)
        try:
            with in_phase("setup"):
                controller.setup()
            with in_phase("train"):
                controller.train()
            objective = controller.objective()
        finally:
            _cleanup(controller, run_dir)
    except HybridRLError as e:
        log.error("error: %s%s", e, _at_step(e))
        sys.stderr.flush()
        sys.exit(2)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated)
        where = f" during {phase_of(e)}" if phase_of(e) else ""
        if step_of(e) is not None:
            where += f" of step {step_of(e)}"
        what, code = ("terminated (SIGTERM)", 143) if isinstance(e, Terminated) else ("interrupted", 130)
        log.error("%s%s; workers stopped", what, where)  # cleanup already ran in the finally above
        sys.exit(code)
    except SystemExit:
        raise
    except BaseException as e:  # a bug or a library's crash (some, like DCP's CheckpointException, are BaseExceptions)
        log.error("%s", crash_line(e, log_traceback(e, run_dir)))
        sys.exit(1)
    finally:
        unlock_dir(run_dir)
    log.info("%s", controller.summary(objective))
    log.info("done: outputs in %s", os.path.relpath(run_dir))
    return objective


def _at_step(e: BaseException) -> str:
    """` (in step 12)` for an error raised during a training step, else empty."""
    step = step_of(e)
    return f" (in step {step})" if step is not None else ""


def _cleanup(controller, run_dir: str) -> None:
    """Stop workers; a failure (or a second Ctrl-C) here is one line, never a traceback over the first error."""
    try:
        controller.cleanup()
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the run is ending either way
        where = log_traceback(e, run_dir)
        log.error("cleanup failed: %s: %s (traceback in %s)", type(e).__name__, _first_line(e), where)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


def crash_line(e: BaseException, traceback_at: str) -> str:
    """`error in generate: RuntimeError: CUDA out of memory (full traceback in outputs/.../hybridrl.log)`."""
    phase = phase_of(e)
    where = f" in {phase}" if phase else ""
    if step_of(e) is not None:
        where += f" of step {step_of(e)}"
    return f"error{where}: {type(e).__name__}: {_first_line(e)} (full traceback in {traceback_at})"


def log_traceback(e: BaseException, run_dir: str) -> str:
    """Write `e`'s traceback to the run dir's log file only (not the console); returns where it went."""
    root = Path(run_dir).resolve()
    handlers = [
        h
        for h in {*logging.getLogger().handlers, *log.handlers}
        if isinstance(h, logging.FileHandler) and root in Path(h.baseFilename).resolve().parents
    ]
    if handlers:  # Hydra's file handler (hybridrl.log): the traceback lands between the run's own lines
        exc_info = (type(e), e, e.__traceback__)
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "traceback of the error below:", (), exc_info)
        for h in handlers:
            h.handle(record)
        return os.path.relpath(handlers[0].baseFilename)
    path = root / "hybridrl.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(traceback.format_exception(type(e), e, e.__traceback__)))
    return os.path.relpath(path)


@hydra.main(version_base="1.3", config_path="pkg://hybridrl.conf", config_name="config")
def _hydra_entry(cfg: DictConfig) -> float:
    return run(cfg)


def _raise_terminated(signum: int, frame) -> None:
    raise Terminated()


def main() -> None:
    """Console-script entry point (`hybridrl ...`), same as `python -m hybridrl ...`.

    Under torchrun (RANK and WORLD_SIZE set) every rank comes here: rank 0 runs the app below, the others serve
    it (hybridrl/workers/torchrun_rank.py).
    """
    from hybridrl.workers.torchrun_env import launched_rank

    if launched_rank() is not None:
        from hybridrl.workers.torchrun_rank import run_rank

        run_rank(_main)
    _main()


def _main() -> None:
    """The app: compose, run, and print any failure as one line.

    `--help` prints `hybridrl.cli.help_text`. Moved keys on the command line fail before Hydra composes. Hydra's
    composition errors (printed by Hydra over several lines) are raised to here and printed as one line, unless the
    user set HYDRA_FULL_ERROR=1 to see them whole; so are errors before the run starts (a run dir another run holds,
    a folder that cannot be written). SIGTERM raises `Terminated` in the main thread, handled like Ctrl-C.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from hybridrl.cli import help_text, wants_help

    if wants_help(sys.argv[1:]):  # Hydra's help lists no recipe group and no key's meaning
        print(help_text("hybridrl"))
        sys.exit(0)
    moved = moved_key_in_overrides(sys.argv[1:])
    if moved:
        print(f"error: {moved}", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGTERM, _raise_terminated)
    user_full = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing; we print one line below
    try:
        _hydra_entry()
    except (HydraException, OmegaConfBaseException) as e:
        if user_full:
            raise
        print(f"error: {composition_error_line(e)}", file=sys.stderr)
        sys.exit(2)
    except RunNotStarted as e:  # the run dir's lock, taken before Hydra writes into the run dir
        print(f"error: {e.error}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # Hydra could not make or write its folders (a read-only or full disk)
        if user_full:
            raise
        where = f" {e.filename}" if e.filename else ""
        print(f"error: cannot write{where}: {e.strerror or e}; choose a run dir you can write to", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        print("terminated (SIGTERM)" if terminated else "interrupted", file=sys.stderr)
        sys.exit(143 if terminated else 130)
    finally:
        if not user_full:
            os.environ.pop("HYDRA_FULL_ERROR", None)
