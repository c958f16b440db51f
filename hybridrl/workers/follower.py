"""A rank other than 0 under `cluster=torchrun`: compose the same config as rank 0, join, answer its commands.

    python -m hybridrl cluster=torchrun ...      (started by torchrun as rank r > 0)
        compose the config as the Hydra app does, writing nothing (no run dir, no log file, no .hydra/)
        join the compute group and the gloo pair group [0, r]
        loop: command from rank 0 → CHECK_CONFIG (same config as rank 0's?) | INIT | a phase | SHUTDOWN → answer

Only rank 0 writes the run's outputs and logs at INFO; a follower prints warnings and errors to its stderr,
prefixed `[rank r]`, and its errors in a phase travel to rank 0, which names them. A watchdog thread ends the
follower when rank 0 ends the run (a key in the launcher's store) while it is stuck in a phase, or when the store's
host is gone: no rank outlives its controller.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

from omegaconf import DictConfig, open_dict, read_write

from hybridrl.config import RunConfig, register_configs, validate
from hybridrl.config_checks import check_composed, composition_error_line, moved_key_in_overrides
from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.workers.control import (
    CHECK_CONFIG,
    NCCL_ERROR_HANDLING,
    SHUTDOWN,
    StopSignal,
    WorkerHost,
    link_timeout_s,
    recv_message,
    send_message,
)
from hybridrl.workers.dist import init_process_group, pick_device
from hybridrl.workers.failures import error_summary
from hybridrl.workers.torchrun_env import LaunchEnv, check_not_launched, read_launch_env

log = logging.getLogger("hybridrl")

#: What `hybridrl.app`'s @hydra.main composes (config_path, config_name).
APP_CONFIG = ("pkg://hybridrl.conf", "config")
SWEEP_REFUSED = "sweeps (-m/--multirun) do not run under torchrun: launch one torchrun per run"
WATCH_EVERY_S = 2.0  # how often the watchdog asks the store whether rank 0 ended the run


def parse_command_line(argv: list[str]):
    """The command line as Hydra's own parser reads it for the app."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(argv)


def prints_only(args) -> bool:
    """--help, --cfg, --info and the like: rank 0 prints the answer, the other ranks have nothing to do."""
    return bool(args.help or args.hydra_help or args.cfg or args.info or args.shell_completion)


def refuse_sweep(args) -> None:
    """A sweep launches many runs from one process; under torchrun each run is a torchrun of its own."""
    if args.multirun:
        raise ConfigError(SWEEP_REFUSED)


def compose_as_the_app(argv: list[str]) -> DictConfig | None:
    """The job config that rank 0's Hydra app composes from the same command line, through the same Hydra calls
    (`hydra.main`'s search path, config name and overrides), without running the job: nothing is written.
    None for a command that only prints."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    args = parse_command_line(argv)
    if prints_only(args):
        return None
    refuse_sweep(args)
    register_configs()
    config_path = args.config_path or APP_CONFIG[0]
    config_name = args.config_name or APP_CONFIG[1]
    search_path = create_automatic_config_search_path(None, "hybridrl.app", config_path)
    if args.config_dir is not None:  # as hydra.main adds --config-dir
        search_path.prepend(
            provider="command-line",
            path=f"file://{os.path.abspath(args.config_dir)}",
            anchor=SearchPathQuery(provider="schema"),
        )
    GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2(task_name="hybridrl", config_search_path=search_path)
    if hydra.get_mode(config_name=config_name, overrides=args.overrides) == RunMode.MULTIRUN:
        raise ConfigError("hydra.mode=MULTIRUN (a sweep) does not run under torchrun: launch one torchrun per run")
    try:
        cfg = hydra.compose_config(config_name, args.overrides, run_mode=RunMode.RUN, with_log_configuration=False)
    finally:
        GlobalHydra.instance().clear()
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]  # as Hydra's run_job hands the job its config
    return cfg


def config_difference(mine: Any, theirs: Any, key: str = "") -> str | None:
    """The first key where two configs (dataclasses, dicts, lists, values) differ, with both values; else None."""
    if dataclasses.is_dataclass(mine) and type(mine) is type(theirs):
        for f in dataclasses.fields(mine):
            diff = config_difference(getattr(mine, f.name), getattr(theirs, f.name), f"{key}.{f.name}".lstrip("."))
            if diff:
                return diff
        return None
    if isinstance(mine, dict) and isinstance(theirs, dict) and mine.keys() == theirs.keys():
        for k in mine:
            diff = config_difference(mine[k], theirs[k], f"{key}.{k}".lstrip("."))
            if diff:
                return diff
        return None
    if isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple)) and len(mine) == len(theirs):
        for i, (a, b) in enumerate(zip(mine, theirs)):
            diff = config_difference(a, b, f"{key}[{i}]")
            if diff:
                return diff
        return None
    if mine != theirs or type(mine) is not type(theirs):
        return f"{key or 'the config'}: {mine!r} here, {theirs!r} on rank 0"
    return None


def check_same_config(mine: RunConfig, rank0: RunConfig) -> None:
    """Every rank must run rank 0's config: the same command line and the same environment variables it reads."""
    diff = config_difference(mine, rank0)
    if diff:
        raise ConfigError(
            f"this rank composed another config than rank 0 ({diff}); give every rank the same command line and "
            "the same environment variables the config reads"
        )


def _log_to_stderr(rank: int) -> None:
    """Warnings and errors only, prefixed with the rank: rank 0 speaks for the run."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}][%(name)s][%(levelname)s] - %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)


def follow(argv: list[str], rank: int) -> int:
    """Serve rank 0 for the run `argv` describes; the exit status (errors printed as one line)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank: rank 0 decides, then shuts us down
    _log_to_stderr(rank)
    moved = moved_key_in_overrides(argv)
    try:
        if moved:
            raise ConfigError(moved)
        composed = compose_as_the_app(argv)
        if composed is None:
            return 0
        check_composed(composed)
        cfg = validate(composed)
        check_not_launched(cfg.cluster.name)
        if cfg.cluster.name != "torchrun":
            raise ConfigError(
                f"RANK={rank} and WORLD_SIZE are set, so this process would serve rank 0 of a cluster=torchrun run, "
                f"but cluster={cfg.cluster.name}: add cluster=torchrun, or unset RANK and WORLD_SIZE"
            )
        env = read_launch_env()
    except HybridRLError as e:
        log.error("error: %s", e)
        return 2
    except Exception as e:  # noqa: BLE001 - Hydra's and OmegaConf's composition errors
        log.error("error: %s", composition_error_line(e))
        return 2
    return serve(cfg, env)


def serve(cfg: RunConfig, env: LaunchEnv) -> int:
    """Join rank 0 and answer its commands until SHUTDOWN (0), or until it is gone (1)."""
    os.environ.update(NCCL_ERROR_HANDLING)
    timeout_s = cfg.cluster.collective_timeout_s
    try:
        device = pick_device(cfg.trainer.device, env.local_rank)
        init_process_group(env.rank, env.world_size, device, timeout_s)
        group = cfg.topology(env.rank).control_groups(link_timeout_s(timeout_s))[0]
    except Exception as e:  # noqa: BLE001 - rank 0 never came (it failed first, or the rendezvous timed out)
        log.error("error: could not join rank 0 at %s:%d: %s", env.master_addr, env.master_port, error_summary(e))
        return 1

    def make_worker():
        from hybridrl.workers.worker import HybridWorker

        return HybridWorker(cfg, rank=env.rank, world_size=env.world_size, local_rank=env.local_rank)

    host = WorkerHost(make_worker)
    leaving = threading.Event()
    _start_watchdog(env, leaving)
    while True:
        try:
            name, args, kwargs = recv_message(0, group)
        except Exception as e:  # noqa: BLE001 - rank 0 is gone (its process ended), or silent past the link timeout
            log.warning("rank 0 is gone (%s); leaving", error_summary(e))
            return 1
        if name == SHUTDOWN:
            leaving.set()
            try:
                send_message(("ok", None), 0, group)
                host.shutdown()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
            return 0
        try:
            if name == CHECK_CONFIG:
                check_same_config(cfg, args[0])
                value = None
            else:
                value = host.handle(name, args, kwargs)
            reply: tuple = ("ok", value)
        except Exception as e:  # noqa: BLE001 - rank 0 decides what a failure means
            reply = ("error", error_summary(e), traceback.format_exc())
        try:
            send_message(reply, 0, group)
        except Exception as e:  # noqa: BLE001
            log.warning("cannot answer rank 0 (%s); leaving", error_summary(e))
            return 1


def leave(code: int):
    """End this process now: the atexit hooks and the logs flushed, then os._exit, skipping the interpreter's teardown,
    which can abort in DeviceMesh/DTensor (PLATFORM_FACTS) or wait on a thread stuck in a collective."""
    import atexit

    try:
        atexit._run_exitfuncs()
    except Exception:  # noqa: BLE001 - leaving anyway
        pass
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _start_watchdog(env: LaunchEnv, leaving: threading.Event) -> None:
    """End this process when rank 0 ends the run (or the store's host is gone) while the main thread is stuck."""
    try:
        stop = StopSignal(env)
    except Exception as e:  # noqa: BLE001
        log.warning("no watchdog on rank 0's end of the run (store at %s:%d: %s)", env.master_addr, env.master_port, e)
        return

    def watch() -> None:
        misses = 0
        while True:
            time.sleep(WATCH_EVERY_S)
            try:
                ended = stop.is_set()
                misses = 0
            except Exception:  # noqa: BLE001 - the store's host ended
                misses += 1
                ended = misses >= 3
            if not ended:
                continue
            if leaving.is_set():  # the main thread is shutting down normally: give it time
                time.sleep(30.0)
                leave(0)
            log.warning("rank 0 ended the run while this rank was still in a phase; leaving")
            leave(1)

    threading.Thread(target=watch, daemon=True, name="hybridrl-watchdog").start()
