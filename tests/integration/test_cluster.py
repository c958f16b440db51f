"""Several workers end to end: `cluster=local` (N processes on this node) and `cluster=ray` (actors).

Each test runs the app in a subprocess, records every process the app starts (its descendants,
polled while it runs) and checks that none is left once it ends. Failures are injected with the
test-only hook HYBRIDRL_TEST_FAULT=<rank>:<phase>:<nth call>:<kill|raise|hang|stop> (tests/faults/sitecustomize.py,
on the app's PYTHONPATH only in these tests).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.paths import TESTS

FAULTS = TESTS / "faults"  # the test-only fault hook (a sitecustomize module)
FAST = ["model.tiny.pretrain_steps=0", "data.train_batch_size=4", "algorithm.group_size=4", "logger.progress_bar=false"]
LOCAL2 = ["cluster=local", "cluster.workers_per_node=2"]
# Metrics that depend on the clock or the process layout, not on what was learned.
LAYOUT_KEYS = ("time/", "perf/", "memory/", "reshard/", "offload/")  # timings, memory, offload figures
# float32 on CPU: FSDP's all-reduce over 2 ranks sums in another order than one rank does (~1e-7 seen).
REL_TOL, ABS_TOL = 1e-4, 1e-5


# -- processes ----------------------------------------------------------------------------
def _ppid_map() -> dict[int, int]:
    """pid → parent pid of every process (psutil when present, else /proc)."""
    try:
        import psutil

        # Processes come and go while we look (other tests, our own workers): ask for ppid in one pass, and
        # skip the ones already gone.
        return {
            p.info["pid"]: p.info["ppid"] for p in psutil.process_iter(["pid", "ppid"]) if p.info["ppid"] is not None
        }
    except ImportError:
        out = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    out[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    pass
        return out


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for p, pp in _ppid_map().items():
        children.setdefault(pp, []).append(p)
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def logged_pids(log_text: str) -> set[int]:
    """The worker pids the group logs at start ("local workers: rank 0 pid 123, ...")."""
    line = re.search(r"(?:local|ray) workers: (.*)", log_text)
    return {int(p) for p in re.findall(r"pid (\d+)", line.group(1))} if line else set()


def assert_all_gone(pids: set[int], within_s: float = 20.0) -> None:
    end = time.monotonic() + within_s
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.2)
    left = sorted(p for p in pids if _alive(p))
    assert not left, f"processes left behind: {left}"


class AppRun:
    """The app in a subprocess; `seen` gathers every descendant pid while it runs."""

    def __init__(self, args: list[str], tmp: Path, env: dict[str, str] | None = None) -> None:
        self.run_dir, self.seen = tmp / "run", set()
        self.out_path, self.err_path = tmp / "stdout.txt", tmp / "stderr.txt"
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline", HOME=str(tmp / "home"), **(env or {}))
        if "HYBRIDRL_TEST_FAULT" in full_env:
            full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")]))
        (tmp / "home").mkdir(exist_ok=True)
        with self.out_path.open("w") as out, self.err_path.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hybridrl", *FAST, *args, f"hydra.run.dir={self.run_dir}"],
                cwd=tmp,
                env=full_env,
                stdout=out,
                stderr=err,
            )

    def poll_until(self, done, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not done():
            if time.monotonic() > end:
                self.proc.kill()
                pytest.fail(f"timed out after {timeout}s:\n{self.output[-3000:]}")
            self.seen |= _descendants(self.proc.pid)
            time.sleep(0.2)

    def wait(self, timeout: float = 420) -> int:
        self.poll_until(lambda: self.proc.poll() is not None, timeout)
        return self.proc.returncode

    @property
    def output(self) -> str:
        return self.out_path.read_text() + self.err_path.read_text()

    def log_text(self) -> str:
        path = self.run_dir / "hybridrl.log"
        return path.read_text() if path.exists() else ""

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_metrics(rows: list[dict], ref: list[dict], model_rewards: bool = False) -> None:
    """Same steps, the same sampled tokens (response statistics exact), rewards exact, the rest close. With
    `model_rewards` a reward model scores the rollouts: its outputs round differently when the batch is split over
    other ranks (the GEMMs see other shapes), so the reward statistics are close to float32 rounding, not exact."""
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    for row, want in zip(rows, ref):
        for key, value in want.items():
            if key.startswith(LAYOUT_KEYS) or not isinstance(value, (int, float)):
                continue
            assert key in row, key
            # The same tokens were sampled: their scores are exact (the reward's KL comes from log-probs: close).
            if key.startswith("reward/") and key != "reward/kl_penalty_mean" and model_rewards:
                assert math.isclose(row[key], value, rel_tol=1e-5, abs_tol=1e-6), (row["step"], key, row[key], value)
            elif key.startswith(("reward/", "response/")) and key != "reward/kl_penalty_mean":
                assert row[key] == value, (row["step"], key, row[key], value)
            else:
                assert math.isclose(row[key], value, rel_tol=REL_TOL, abs_tol=ABS_TOL), (
                    row["step"],
                    key,
                    row[key],
                    value,
                )


@pytest.fixture(scope="module")
def one_worker_metrics(tmp_path_factory) -> list[dict]:
    """The reference: 3 steps with one inline worker."""
    run = AppRun(["trainer.steps=3"], tmp_path_factory.mktemp("inline"))
    assert run.wait() == 0, run.output[-3000:]
    return run.metrics()


# -- cluster=local ------------------------------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "tp, fsdp",
    [
        (1, []),
        (2, []),
        # Per-layer FSDP units freed after forward, a reduce-scatter every micro-batch: the other sharding path.
        (1, ["trainer.fsdp_layers_per_unit=1", "trainer.reshard_after_forward=true"]),
    ],
    ids=["tp1", "tp2", "per-layer-units"],
)
def test_two_local_workers_match_one(tmp_path, one_worker_metrics, tp, fsdp):
    """Same global batch and seed: 2 workers (and one engine TP group of 2) give 1 worker's metrics."""
    run = AppRun([*LOCAL2, f"engine.tp_size={tp}", "trainer.steps=3", *fsdp], tmp_path)
    assert run.wait() == 0, run.output[-3000:]
    assert_same_metrics(run.metrics(), one_worker_metrics)
    workers = logged_pids(run.log_text())
    assert len(workers) == 2 and workers <= run.seen
    assert_all_gone(run.seen)


@pytest.mark.multiproc
def test_agent_turns_at_tp2_match_one_worker(tmp_path):
    """rollout=agent with one engine TP group of 2: the TP leader runs the agent loop (its turns joining the running
    batch one by one), here in a child process of its own (`agent.process=child`, a GPU's default), and the other
    rank replays its engine steps (engines/lockstep.py); the trajectories, the rewards and the updates are one inline
    worker's, whose loop runs in its own process."""
    agent = ["recipe=cpu_agent", "trainer.steps=2"]
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = AppRun(agent, tmp_path / "one")
    assert one.wait() == 0, one.output[-3000:]
    two = AppRun([*agent, *LOCAL2, "engine.tp_size=2", "agent.process=child"], tmp_path / "two")
    assert two.wait() == 0, two.output[-3000:]
    clock = "agent/tool_seconds"  # how long the tools took: the clock's, not the run's
    rows, ref = ([{k: v for k, v in r.items() if k != clock} for r in run.metrics()] for run in (two, one))
    assert "agent loop: its turns run in a child process" in two.output + two.log_text()
    assert "agent loop: its turns run in a child process" not in one.output + one.log_text()
    assert any(r["agent/turns_mean"] > 1 for r in ref)  # some trajectories went on after a tool turn
    assert_same_metrics(rows, ref)
    assert_all_gone(two.seen)


# PPO with a critic (warm-up step included) and a reward model: every role's numbers, not only the actor's.
PPO = ["algorithm=ppo", "critic.lr=5e-3", "critic.warmup_steps=1", "reward_model=tiny", "trainer.steps=3"]


@pytest.mark.multiproc
def test_two_local_workers_match_one_with_a_critic(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = AppRun(PPO, tmp_path / "one")
    assert one.wait() == 0, one.output[-3000:]
    two = AppRun([*LOCAL2, *PPO], tmp_path / "two")
    assert two.wait() == 0, two.output[-3000:]
    ref = one.metrics()
    assert {"critic/value_loss", "critic/grad_norm", "critic/explained_var", "reward/tiny_rm"} <= set(ref[-1])
    assert_same_metrics(two.metrics(), ref, model_rewards=True)
    assert_all_gone(two.seen)


@pytest.mark.multiproc
def test_deferred_gradient_sync_equals_a_reduce_per_micro_batch(tmp_path):
    """Two micro-batches per rank: one reduce-scatter after both (the default) trains like one after each."""
    runs = {}
    for defer in ("true", "false"):
        (tmp_path / defer).mkdir()
        run = AppRun(
            [*LOCAL2, "trainer.steps=2", "trainer.micro_batch_size=4", f"trainer.defer_grad_sync={defer}"],
            tmp_path / defer,
        )
        assert run.wait() == 0, run.output[-3000:]
        runs[defer] = run.metrics()
    assert_same_metrics(runs["true"], runs["false"])


@pytest.mark.multiproc
def test_killed_worker_fails_the_run_naming_rank_and_phase(tmp_path):
    run = AppRun([*LOCAL2, "trainer.steps=3"], tmp_path, env={"HYBRIDRL_TEST_FAULT": "1:update:2:kill"})
    assert run.wait() != 0
    out = run.output
    assert "error: worker rank 1 died during 'update' (exit code -9: SIGKILL)" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert [r["step"] for r in run.metrics()] == [1]
    assert len(logged_pids(run.log_text())) == 2
    assert_all_gone(run.seen | logged_pids(run.log_text()))


@pytest.mark.multiproc
def test_raising_worker_fails_the_run_with_its_error(tmp_path):
    run = AppRun([*LOCAL2, "trainer.steps=2"], tmp_path, env={"HYBRIDRL_TEST_FAULT": "0:generate:1:raise"})
    assert run.wait() != 0
    out = run.output
    assert "error: worker rank 0 raised in 'generate': ValueError: injected test fault" in out, out[-3000:]
    # The worker's traceback is in the log once; the controller adds none of its own.
    assert out.count("Traceback (most recent call last)") == 1, out[-3000:]
    assert run.log_text().count("Traceback (most recent call last)") == 1
    assert_all_gone(run.seen)


@pytest.mark.multiproc
def test_hung_worker_times_out(tmp_path):
    args = [*LOCAL2, "trainer.steps=2", "cluster.collective_timeout_s=20"]
    run = AppRun(args, tmp_path, env={"HYBRIDRL_TEST_FAULT": "1:reward:1:hang"})
    assert run.wait() != 0
    out = run.output
    assert "error: worker rank 1 timed out during 'reward'" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert_all_gone(run.seen)


@pytest.mark.multiproc
def test_workers_die_with_a_killed_controller(tmp_path):
    """SIGKILL the app while rank 0 is busy in a phase: no cleanup code runs, the workers still go."""
    run = AppRun([*LOCAL2, "trainer.steps=2"], tmp_path, env={"HYBRIDRL_TEST_FAULT": "0:reward:1:hang"})
    run.poll_until(lambda: "test fault: rank 0 hangs in 'reward'" in run.log_text() or run.proc.poll() is not None, 420)
    assert run.proc.poll() is None, run.output[-3000:]
    run.seen |= _descendants(run.proc.pid)
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(30)
    assert_all_gone(run.seen)


# -- cluster=ray --------------------------------------------------------------------------
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason='needs Ray: pip install "hybridrl[ray]"')


@pytest.mark.slow
@needs_ray
def test_ray_two_workers_match_one(tmp_path, one_worker_metrics):
    run = AppRun(["cluster=ray", "cluster.workers_per_node=2", "trainer.steps=2"], tmp_path)
    assert run.wait() == 0, run.output[-3000:]
    assert_same_metrics(run.metrics(), one_worker_metrics[:2])
    workers = logged_pids(run.log_text())
    assert len(workers) == 2 and workers <= run.seen
    assert_all_gone(run.seen)


@pytest.mark.slow
@needs_ray
def test_ray_killed_worker_fails_the_run(tmp_path):
    args = ["cluster=ray", "cluster.workers_per_node=2", "trainer.steps=3"]
    run = AppRun(args, tmp_path, env={"HYBRIDRL_TEST_FAULT": "1:update:2:kill"})
    assert run.wait() != 0
    out = run.output
    assert "error: worker rank 1 died during 'update'" in out, out[-3000:]
    assert_all_gone(run.seen)
    kept = re.search(r"Ray's logs are kept in (\S+)", out)
    if kept:
        shutil.rmtree(kept.group(1), ignore_errors=True)
