"""What each process torchrun starts does with `python -m hybridrl ...`: rank 0 runs the Hydra app (the controller
and its own worker), every other rank serves it (workers/follower.py).

    torchrun --nproc_per_node 2 -m hybridrl cluster=torchrun trainer.steps=4
        rank 0 → the app, exactly as without torchrun → cluster=torchrun's worker group drives the others
        rank 1 → follow(): the same config composed, nothing written, commands answered until shut down

Both end through `leave`, so a process that held a DeviceMesh never aborts in the interpreter's teardown.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from hybridrl.workers.follower import SWEEP_REFUSED, follow, leave
from hybridrl.workers.torchrun_env import launched_rank

log = logging.getLogger("hybridrl")


def exit_status(code: object) -> int:
    """The status `sys.exit(code)` gives the process (a message means 1, as Python prints it)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_rank(app_main: Callable[[], None]) -> NoReturn:
    """Run this rank's part of the launch and end the process with its status."""
    rank = launched_rank()
    if rank:
        leave(follow(sys.argv[1:], rank))
    if {"-m", "--multirun"} & set(sys.argv[1:]):
        print(f"error: {SWEEP_REFUSED}", file=sys.stderr)
        leave(2)
    try:
        app_main()
        status = 0
    except SystemExit as e:
        status = exit_status(e.code)
    except KeyboardInterrupt:
        status = 130
    except BaseException:  # noqa: BLE001 - the app reports its own errors; this is a last resort
        traceback.print_exc()
        status = 1
    leave(status)
