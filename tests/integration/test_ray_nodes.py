"""`cluster=ray` over two Ray nodes on this machine (`ray start --head`, `ray start --address ...`, one CPU each, so
the run's placement must span both), against `cluster=local` with the same world size; and a private Ray that
leaves no file outside the run's temporary folder.

The two nodes run in sessions of their own (`ray start --block`); on every exit path the fixture kills both process
groups, then any process still naming the cluster's folder, by pid, with a deadline.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_cluster import LOCAL2, AppRun, assert_all_gone
from tests.integration.test_torchrun import assert_metrics_equal

RAY_CLI = Path(sys.executable).parent / "ray"
needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None or not RAY_CLI.exists(), reason='needs Ray: pip install "hybridrl[ray]"'
)
START_S = 120.0  # a node's start on a loaded 2-core machine
STOP_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _pids_naming(text: str) -> list[int]:
    """Processes whose command line contains `text` (the cluster's own folder: only ours do)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                out.append(int(entry))
    return out


def _wait_for(path: Path, pattern: str, proc: subprocess.Popen, deadline_s: float) -> re.Match:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        found = re.search(pattern, path.read_text())
        if found:
            return found
        if proc.poll() is not None:
            pytest.fail(f"ray start exited with {proc.returncode}:\n{path.read_text()[-3000:]}")
        time.sleep(0.3)
    pytest.fail(f"no {pattern!r} from ray start within {deadline_s:.0f}s:\n{path.read_text()[-3000:]}")


@pytest.fixture()
def ray_two_nodes(tmp_path) -> Iterator[tuple[str, dict[str, str]]]:
    """A Ray cluster of two nodes with one CPU each, token auth on, every file in one short temporary folder:
    yields (address, the environment a driver needs)."""
    folder = tempfile.mkdtemp(prefix="hr-", dir="/tmp")  # short: Ray's socket paths must stay under ~107 bytes
    token = Path(folder) / "auth_token"
    token.write_text("0123456789abcdef" * 4)
    token.chmod(0o600)
    (tmp_path / "home").mkdir(exist_ok=True)
    env = dict(
        os.environ,
        HOME=str(tmp_path / "home"),
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token),
        RAY_USAGE_STATS_ENABLED="0",
    )
    procs: list[subprocess.Popen] = []

    def start(args: list[str], log: Path) -> subprocess.Popen:
        with log.open("w") as out:
            proc = subprocess.Popen(
                [str(RAY_CLI), "start", "--num-cpus=1", "--disable-usage-stats", "--block", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the cleanup kills all of it, and nothing else
            )
        procs.append(proc)
        return proc

    try:
        head_log = tmp_path / "ray-head.txt"
        head = start(
            ["--head", f"--port={_free_port()}", "--include-dashboard=false", f"--temp-dir={folder}/ray"], head_log
        )
        address = _wait_for(head_log, r"--address='([^']+)'", head, START_S).group(1)
        worker_log = tmp_path / "ray-worker.txt"
        worker = start([f"--address={address}"], worker_log)
        _wait_for(worker_log, r"Ray runtime started", worker, START_S)
        yield address, {k: env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_USAGE_STATS_ENABLED")}
    finally:
        for proc in reversed(procs):  # the worker node first, then the head
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        end = time.monotonic() + STOP_S
        while (left := _pids_naming(folder)) and time.monotonic() < end:
            for pid in left:  # a process that left the group (a daemon of Ray's) but still runs from our folder
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.3)
        for proc in procs:
            proc.wait(STOP_S)
        shutil.rmtree(folder, ignore_errors=True)
        assert not _pids_naming(folder), f"Ray processes left behind: {_pids_naming(folder)}"


@pytest.mark.slow
@pytest.mark.multiproc
@needs_ray
def test_ray_over_two_nodes_equals_local(tmp_path, ray_two_nodes):
    """`cluster=ray cluster.nnodes=2` places one worker on each node and trains as `cluster=local` with 2 workers."""
    address, ray_env = ray_two_nodes
    (tmp_path / "local").mkdir()
    (tmp_path / "ray").mkdir()
    local = AppRun([*LOCAL2, "trainer.steps=3"], tmp_path / "local")
    assert local.wait() == 0, local.output[-3000:]
    args = ["cluster=ray", "cluster.nnodes=2", "cluster.workers_per_node=1", f"cluster.ray_address={address}"]
    run = AppRun([*args, "trainer.steps=3"], tmp_path / "ray", env=ray_env)
    assert run.wait() == 0, run.output[-3000:]
    assert_metrics_equal(run.metrics(), local.metrics())
    line = re.search(r"ray workers: (.*)", run.log_text()).group(1)
    assert len(set(re.findall(r"\(node (\w+)\)", line))) == 2, line  # the placement spans both nodes
    assert_all_gone({int(p) for p in re.findall(r"pid (\d+)", line)})


@pytest.mark.slow
@needs_ray
def test_private_ray_writes_nothing_outside_the_run(tmp_path):
    """Without cluster.ray_address the run's own Ray keeps every file (the auth token included) in one temporary
    folder, and removes it: nothing of Ray's stays in the home folder, $TMPDIR or /tmp/ray."""
    tmpdir = Path(tempfile.mkdtemp(prefix="hr-tmp-", dir="/tmp"))
    ray_default = Path("/tmp/ray")
    existed = ray_default.exists()
    try:
        run = AppRun(["cluster=ray", "trainer.steps=1"], tmp_path, env={"TMPDIR": str(tmpdir)})
        assert run.wait() == 0, run.output[-3000:]
        home = tmp_path / "home"
        assert not (home / ".ray").exists(), sorted(p.name for p in home.iterdir())
        # torch's compile cache is torch's (a run without Ray leaves it too); nothing else may remain.
        left = sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_"))
        assert not left, left
        assert existed or not ray_default.exists()
        assert "Generated new authentication token" not in run.output
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
