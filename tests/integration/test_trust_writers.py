"""One writer per run dir, SIGTERM, and the small ones at start-up, in real runs (`python -m hybridrl` in a subprocess):
two runs started into one folder, a resume into a folder another run holds, SIGTERM during an update and during a
save, a read-only run dir, an optimizer key torch would refuse.

    .venv/bin/python -m pytest -q -m faults tests/integration/test_trust_writers.py
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_cluster import FAULTS
from tests.integration.test_trust_failures import mount_tmpfs
from tests.integration.test_trust_faults import FAST, run_app, steps

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def start_app(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hybridrl", *args],
        cwd=cwd,
        env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def read_until(p: subprocess.Popen, text: str, timeout_s: float = 180) -> str:
    """The app's output up to the first line holding `text` (fails if it ends or the time passes first)."""
    seen, end = "", time.monotonic() + timeout_s
    while time.monotonic() < end:
        if select.select([p.stdout], [], [], 1.0)[0]:
            line = p.stdout.readline()
            if not line and p.poll() is not None:
                break
            seen += line
            if text in line:
                return seen
    raise AssertionError(f"{text!r} never appeared:\n{seen[-3000:]}")


def errors_of(out: str) -> list[str]:
    return [line for line in out.splitlines() if "ERROR" in line or line.startswith("error:")]


def test_a_second_run_into_a_held_run_dir_exits_at_once_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    first = start_app(
        [*FAST, "trainer.steps=40", "trainer.save_every=1", "trainer.lr=2e-3", f"hydra.run.dir={run}"], tmp_path
    )
    try:
        read_until(first, "step 1 ")
        for extra in ([], ["trainer.resume=auto"]):
            t0 = time.monotonic()
            r = run_app(
                [*FAST, "trainer.steps=6", "trainer.save_every=1", "trainer.lr=1e-4", *extra, f"hydra.run.dir={run}"],
                tmp_path,
            )
            out = r.stdout + r.stderr
            assert r.returncode == 2, out[-3000:]
            assert errors_of(out) == [
                l
                for l in out.splitlines()
                if l.startswith(
                    f"error: hydra.run.dir={run} is in use by another run "
                    f"(pid {first.pid} on host {socket.gethostname()}, started "
                )
            ], out[-3000:]
            assert len(errors_of(out)) == 1 and "trainer.lr=2e-3" in errors_of(out)[0]  # the holder's command
            assert "Traceback" not in out
            assert time.monotonic() - t0 < 90  # before any model loads
        out, _ = first.communicate(timeout=400)
    finally:
        first.kill()
    assert first.returncode == 0, out[-3000:]
    assert steps(run) == list(range(1, 41))  # one row per step: the others never wrote
    assert not list(run.glob("metrics.jsonl.stale-*"))
    assert "trainer.lr=2e-3" in (run / ".hydra" / "overrides.yaml").read_text()  # the holder's config, not theirs
    assert "replacing step_" not in out


def test_a_read_only_run_dir_is_one_line(tmp_path):
    run = tmp_path / "ro"
    run.mkdir()
    mounted = mount_tmpfs(run, "ro,size=64k")
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("root ignores file modes, and this machine does not let us mount a read-only folder")
        run.chmod(0o555)
    try:
        r = run_app([*FAST, "trainer.steps=1", f"hydra.run.dir={run / 'run'}"], tmp_path)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(run)], capture_output=True)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: hydra.run.dir={run / 'run'}: cannot write there ("), out
    assert lines[0].endswith("); choose a folder you can write to")


def test_a_negative_eps_exits_2_naming_the_key(tmp_path):
    r = run_app([*FAST, "trainer.eps=-1", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert r.returncode == 2
    assert errors_of(r.stdout + r.stderr)[-1].endswith(
        "error: trainer.eps must be a finite number >= 0 (AdamW's epsilon, e.g. 1e-8), got -1.0"
    )


def _sigterm_when(p: subprocess.Popen, marker: str) -> str:
    seen = read_until(p, marker)
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)  # what `kill <pid>` and a scheduler send
    out, _ = p.communicate(timeout=120)
    return seen + out


def test_sigterm_during_an_update_is_one_line_and_exit_143(tmp_path):
    env = {"HYBRIDRL_TEST_FAULT": "0:update:2:hang", "PYTHONPATH": str(FAULTS)}
    p = start_app([*FAST, "trainer.steps=4", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, env)
    out = _sigterm_when(p, "hangs in 'update'")
    assert p.returncode == 143, out[-3000:]
    assert errors_of(out) == [
        l for l in out.splitlines() if "terminated (SIGTERM) during update of step 2; workers stopped" in l
    ], out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert steps(tmp_path / "run") == [1]


def test_sigterm_during_a_save_leaves_no_files_behind(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import sys, time\n"
        "import hybridrl.training.checkpoint as c\n"
        "real = c.write_file\n"
        "def write_file(file, data, checkpoint):\n"
        "    print('test hook: the shards are written, the rank state is next', file=sys.stderr, flush=True)\n"
        "    time.sleep(600)\n"
        "c.write_file = write_file\n"
    )
    run = tmp_path / "run"
    p = start_app(
        [*FAST, "trainer.steps=2", "trainer.save_every=1", f"hydra.run.dir={run}"], tmp_path, {"PYTHONPATH": str(hooks)}
    )
    out = _sigterm_when(p, "the shards are written")
    assert p.returncode == 143, out[-3000:]
    assert [l for l in errors_of(out)] == [
        l for l in out.splitlines() if "terminated (SIGTERM) during save_checkpoint of step 1; workers stopped" in l
    ], out[-3000:]
    assert list((run / "checkpoints").iterdir()) == []  # the half-written .tmp-step_000001 was removed


@pytest.mark.multiproc
def test_sigterm_with_local_workers_removes_the_rendezvous_folder(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"HYBRIDRL_TEST_FAULT": "1:update:2:hang", "PYTHONPATH": str(FAULTS), "TMPDIR": str(tmp)}
    args = [*FAST, "trainer.steps=4", "cluster=local", "cluster.workers_per_node=2", f"hydra.run.dir={tmp_path / 'r'}"]
    p = start_app(args, tmp_path, env)
    out = _sigterm_when(p, "hangs in 'update'")
    assert p.returncode == 143, out[-3000:]
    assert len(errors_of(out)) == 1 and "terminated (SIGTERM) during update of step 2; workers stopped" in out
    assert not list(tmp.glob("hybridrl-rdzv-*"))  # its store file went with it
    assert "leaked semaphore" not in out and "Traceback" not in out, out[-3000:]
