"""TEST ONLY: fault injection into worker processes, loaded through PYTHONPATH=tests/faults by the cluster tests.

`HYBRIDRL_TEST_FAULT=<rank>:<phase>:<nth call>[:kill|raise|hang|stop]` makes that worker's nth call of that phase
(or `init`, its construction) fail: SIGKILL, raise, sleep forever, or SIGSTOP itself. Python imports this module at
start-up in every process that has this folder on its path (the app, its spawned workers, Ray's workers); it wraps
`HybridWorker`'s methods once that class is imported, so the product code carries no test hook.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import signal
import sys
import time
from collections import Counter

SPEC = os.environ.get("HYBRIDRL_TEST_FAULT")
TARGET = "hybridrl.workers.worker"


def _fail(rank: int, what: str, mode: str) -> None:
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "stop":
        # The wall clock of the stop, straight to stderr: the forwarded log queue's feeder thread stops with us.
        print(f"test fault: rank {rank} stops in {what!r} at {time.time():.3f}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if mode == "hang":
        import logging

        logging.getLogger("hybridrl").warning("test fault: rank %d hangs in %r", rank, what)
        time.sleep(10**6)
    raise ValueError(f"injected test fault (HYBRIDRL_TEST_FAULT={SPEC})")


def _patch(module) -> None:
    rank_s, phase, nth_s, mode = (SPEC.split(":") + ["kill"])[:4]
    want_rank, nth = int(rank_s), int(nth_s)
    cls = module.HybridWorker
    calls: Counter[str] = Counter()

    def wrap(name: str):
        original = getattr(cls, name)

        def method(self, *args, **kwargs):
            if name == "__init__":
                rank = kwargs.get("rank", args[1] if len(args) > 1 else 0)
            else:
                rank = self.topology.rank
            key = "init" if name == "__init__" else name
            calls[key] += 1
            if (rank, key, calls[key]) == (want_rank, phase, nth):
                _fail(rank, key, mode)
            return original(self, *args, **kwargs)

        setattr(cls, name, method)

    wrap("__init__")
    if phase != "init":
        wrap(phase)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `_patch` right after the worker module is executed."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if SPEC:
    sys.meta_path.insert(0, _AfterImport())
