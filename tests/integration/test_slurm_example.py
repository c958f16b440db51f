"""examples/slurm/hybridrl.sbatch runs as written: a one-node job on this machine, with stand-ins for SLURM's `srun`
(runs its command once, as one task per node would) and `scontrol` (names this host), and two CPU processes for the
node's two "GPUs"."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_cluster import FAST
from tests.paths import REPO

SCRIPT = REPO / "examples" / "slurm" / "hybridrl.sbatch"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stand_in(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def test_the_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.multiproc
def test_the_sbatch_script_trains_on_one_node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stand_in(bin_dir, "srun", 'while [[ "$1" == --* ]]; do shift; done\nexec "$@"')
    _stand_in(bin_dir, "scontrol", "echo localhost")
    (tmp_path / "home").mkdir()
    env = dict(
        os.environ,
        PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        HOME=str(tmp_path / "home"),
        WANDB_MODE="offline",
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_ID="4242",
        SLURM_GPUS_ON_NODE="2",
        RDZV_PORT=str(_free_port()),
        RUN_DIR=str(tmp_path / "run"),
    )
    done = subprocess.run(
        ["bash", str(SCRIPT), *FAST, "trainer.steps=2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    log = (tmp_path / "run" / "hybridrl.log").read_text()
    assert re.search(r"torchrun workers: rank 0 pid \d+ on \S+, rank 1 pid \d+", log), log[-2000:]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
