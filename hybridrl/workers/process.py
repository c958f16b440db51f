"""What a fresh worker process needs before it builds a HybridWorker, whichever backend started it."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence


def reward_modules() -> list[str]:
    """Modules that registered the rewards known here, so a worker process can register them too."""
    from hybridrl.rewards.registry import registered_rewards, resolve_reward

    mods = {getattr(resolve_reward(name), "__module__", None) for name in registered_rewards()}
    return sorted(m for m in mods if m and m != "__main__")


def prepare_worker_process(modules: Sequence[str]) -> None:
    """The rewards' modules imported (they register themselves), no multiprocessing locks in tqdm. (Thread counts
    are the worker's own choice: `hybridrl.cpu_threads`.)"""
    for name in modules:
        importlib.import_module(name)
    try:  # tqdm's default lock is a multiprocessing semaphore that an os._exit leaves "leaked"
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())
    except ImportError:
        pass
