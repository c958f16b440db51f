"""`cluster=torchrun` end to end: the app started by torchrun (`torch.distributed.run --standalone`, two ranks on this
machine) against `cluster=local` with the same world size, and a killed or hung rank.

torchrun writes each rank's stdout and stderr to files of its own here (`--log-dir`, `--redirects 3`), so the
tests can say what rank 0 printed and that rank 1 stayed quiet. The hung-rank test starts the two ranks by hand,
as a launcher without an agent would (RANK, WORLD_SIZE, ... set), so nothing but the product ends the stuck one.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_cluster import (
    FAST,
    FAULTS,
    LAYOUT_KEYS,
    LOCAL2,
    AppRun,
    _alive,
    _descendants,
    assert_all_gone,
)

# Same world size, same code on each rank: the only difference is the transport, so the figures agree to float32
# rounding (in practice they are equal).
REL = 1e-5


def assert_metrics_equal(rows: list[dict], ref: list[dict]) -> None:
    """Step for step: sampled-token statistics and rewards exact, every other learned figure within REL."""
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    for row, want in zip(rows, ref):
        for key, value in want.items():
            if key.startswith(LAYOUT_KEYS) or not isinstance(value, (int, float)):
                continue
            if key.startswith(("reward/", "response/")) and key != "reward/kl_penalty_mean":
                assert row[key] == value, (row["step"], key, row[key], value)
            else:
                assert math.isclose(row[key], value, rel_tol=REL, abs_tol=1e-7), (row["step"], key, row[key], value)


def workers_line(log_text: str) -> dict[int, int]:
    """rank → pid, from the group's start line ("torchrun workers: rank 0 pid 12 on host, ...")."""
    line = re.search(r"torchrun workers: (.*)", log_text)
    return {int(r): int(p) for r, p in re.findall(r"rank (\d+) pid (\d+)", line.group(1))} if line else {}


class TorchrunApp:
    """`torchrun --standalone --nproc_per_node 2 -m hybridrl ...` in `tmp`; each rank's output in its own files."""

    def __init__(
        self, args: list[str], tmp: Path, env: dict[str, str] | None = None, cluster: str = "torchrun"
    ) -> None:
        self.tmp, self.seen = tmp, set()
        self.logs = tmp / "torchrun-logs"
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline", HOME=str(tmp / "home"), **(env or {}))
        if "HYBRIDRL_TEST_FAULT" in full_env:
            full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")]))
        (tmp / "home").mkdir(exist_ok=True)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        launcher += [f"--log-dir={self.logs}", "--redirects=3"]
        with (tmp / "launcher.txt").open("w") as out:
            self.proc = subprocess.Popen(
                [*launcher, "-m", "hybridrl", *FAST, f"cluster={cluster}", *args],
                cwd=tmp,
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait(self, timeout: float = 420, on_poll=None) -> int:
        end = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > end:
                self.proc.kill()
                pytest.fail(f"timed out after {timeout}s:\n{self.rank_output(0)[-3000:]}")
            self.seen |= _descendants(self.proc.pid)
            if on_poll is not None:
                on_poll()
            time.sleep(0.1)
        return self.proc.returncode

    def rank_output(self, local_rank: int) -> str:
        """What that rank printed (stdout, then stderr)."""
        text = ""
        for name in ("stdout.log", "stderr.log"):
            for path in self.logs.glob(f"*/attempt_0/{local_rank}/{name}"):
                text += path.read_text()
        return text

    def run_dirs(self) -> list[Path]:
        return sorted(p for p in (self.tmp / "outputs").glob("*/*") if p.is_dir())

    def log_text(self) -> str:
        dirs = self.run_dirs()
        return (dirs[0] / "hybridrl.log").read_text() if dirs and (dirs[0] / "hybridrl.log").exists() else ""

    def metrics(self) -> list[dict]:
        (run_dir,) = self.run_dirs()
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multiproc
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_torchrun_equals_local(tmp_path, tp):
    """`torchrun --nproc_per_node 2 -m hybridrl cluster=torchrun` trains exactly as `cluster=local` with 2 workers;
    only rank 0 writes a run dir and logs at INFO."""
    (tmp_path / "local").mkdir()
    (tmp_path / "torchrun").mkdir()
    steps = ["trainer.steps=4", f"engine.tp_size={tp}"]
    local = AppRun([*LOCAL2, *steps], tmp_path / "local")
    assert local.wait() == 0, local.output[-3000:]
    run = TorchrunApp(steps, tmp_path / "torchrun")
    assert run.wait() == 0, (tmp_path / "torchrun" / "launcher.txt").read_text()[-3000:] + run.rank_output(0)[-3000:]
    assert len(run.run_dirs()) == 1, run.run_dirs()  # rank 1 composed the config without making a run dir
    assert_metrics_equal(run.metrics(), local.metrics())
    assert set(workers_line(run.log_text())) == {0, 1}
    assert "done: outputs in" in run.rank_output(0)
    follower = run.rank_output(1)
    assert "[INFO]" not in follower and "step 1" not in follower, follower[-2000:]
    assert sorted(p.name for p in (tmp_path / "torchrun").iterdir()) == [
        "home",
        "launcher.txt",
        "outputs",
        "torchrun-logs",
    ]
    assert_all_gone(run.seen)


@pytest.mark.multiproc
@pytest.mark.faults
def test_torchrun_killed_rank_ends_the_run_naming_it(tmp_path):
    """SIGKILL rank 1 in its second update: within the collective timeout the run ends, and rank 0 says in one line
    which rank died and in which phase (torchrun's agent adds its own report below)."""
    timeout_s = 30
    run = TorchrunApp(
        ["trainer.steps=4", f"cluster.collective_timeout_s={timeout_s}"],
        tmp_path,
        env={"HYBRIDRL_TEST_FAULT": "1:update:2:kill"},
    )
    died_at: list[float] = []

    def watch_rank_1() -> None:
        pid = workers_line(run.log_text()).get(1)
        if pid and not died_at and not _alive(pid):
            died_at.append(time.monotonic())

    assert run.wait(on_poll=watch_rank_1) != 0
    ended_at = time.monotonic()
    out = run.rank_output(0)
    assert out.count("error: ") == 1, out[-3000:]
    assert "error: worker rank 1 died during 'update' (pid " in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert died_at and ended_at - died_at[0] < timeout_s, (died_at, ended_at)
    assert [r["step"] for r in run.metrics()] == [1]
    assert_all_gone(run.seen)


@pytest.mark.multiproc
def test_torchrun_without_cluster_torchrun_is_refused(tmp_path):
    """Under torchrun every rank runs `python -m hybridrl`: with another cluster kind each would run a job of its own,
    so the run stops with a line saying to add cluster=torchrun."""
    run = TorchrunApp(["trainer.steps=1"], tmp_path, cluster="local")
    assert run.wait() != 0
    out = run.rank_output(0) + run.rank_output(1)
    assert "but cluster=local: every rank would run a job of its own. Add cluster=torchrun" in out, out[-3000:]
    assert_all_gone(run.seen)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiproc
@pytest.mark.faults
def test_hung_rank_is_named_and_leaves_with_the_run(tmp_path):
    """Two ranks started by hand (a launcher without torchrun's agent): rank 1 hangs in 'reward'; rank 0 names it
    within the deadline, and rank 1, stuck, still leaves once rank 0 has ended the run."""
    port = _free_port()
    base = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        WANDB_MODE="offline",
        HOME=str(tmp_path / "home"),
        HYBRIDRL_TEST_FAULT="1:reward:1:hang",
        PYTHONPATH=os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    (tmp_path / "home").mkdir()
    args = [*FAST, "cluster=torchrun", "trainer.steps=2", "cluster.collective_timeout_s=30"]
    procs = []
    for rank in (0, 1):
        with (tmp_path / f"rank{rank}.txt").open("w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "hybridrl", *args, f"hydra.run.dir={tmp_path / 'run'}"],
                    cwd=tmp_path,
                    env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank)),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        rc0 = procs[0].wait(300)
        rc1 = procs[1].wait(30)  # the stuck rank's watchdog sees the run end within a few seconds
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out0 = (tmp_path / "rank0.txt").read_text()
    assert rc0 == 2, out0[-3000:]
    assert "error: worker rank 1 timed out during 'reward'" in out0, out0[-3000:]
    assert "Traceback" not in out0, out0[-3000:]
    assert rc1 == 1, (tmp_path / "rank1.txt").read_text()[-3000:]
    assert "rank 0 ended the run while this rank was still in a phase" in (tmp_path / "rank1.txt").read_text()
