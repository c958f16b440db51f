"""One writer per run dir: the lock, its holder in the message, release on every exit, takeover of a dead run's lock."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from hybridrl.errors import HybridRLError
from hybridrl.run_lock import LOCK_FILE, RunDirBusy, RunDirLock, lock_dir, unlock_dir

HOLD = """
import sys, time
from hybridrl.run_lock import RunDirLock
RunDirLock(sys.argv[1]).acquire()
print('held', flush=True)
time.sleep(300)
"""


def holder(run_dir) -> subprocess.Popen:
    """Another process holding the lock of `run_dir` (until killed)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_holder_is_refused_naming_pid_and_host(tmp_path):
    p = holder(tmp_path / "run")
    try:
        with pytest.raises(RunDirBusy) as e:
            RunDirLock(tmp_path / "run").acquire()
        msg = str(e.value)
        assert msg.startswith(f"hydra.run.dir={tmp_path / 'run'} is in use by another run (pid {p.pid} on host ")
        assert f"pid {p.pid} on host {socket.gethostname()}, started " in msg and "wait for it to end" in msg
    finally:
        p.kill()
        p.wait()


def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog):
    p = holder(tmp_path)
    p.send_signal(signal.SIGKILL)  # no release: the kernel drops the lock, the record stays
    p.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == p.pid
    lock = RunDirLock(tmp_path)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert f"taking over the lock of a run that ended without releasing it (pid {p.pid} on host" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_release_empties_the_record_and_lets_the_next_run_in_quietly(tmp_path, caplog):
    lock = RunDirLock(tmp_path)
    lock.acquire()
    lock.release()
    lock.release()  # twice is fine
    assert (tmp_path / LOCK_FILE).read_text() == ""
    with caplog.at_level(logging.WARNING):
        again = RunDirLock(tmp_path)
        again.acquire()
    assert "taking over" not in caplog.text
    again.release()


def test_lock_dir_is_taken_once_per_process_and_unlocked_by_path(tmp_path):
    a = lock_dir(tmp_path, "hydra.run.dir")
    assert lock_dir(str(tmp_path), "the job dir") is a  # the callback's lock, reused by the app
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from hybridrl.run_lock import RunDirLock; RunDirLock(sys.argv[1]).acquire()",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 1 and "RunDirBusy" in p.stderr
    unlock_dir(tmp_path)
    assert not a.held
    p = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(300)", ""), str(tmp_path)], capture_output=True)
    assert p.returncode == 0


def test_a_folder_that_cannot_be_written_is_one_error_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(HybridRLError, match=rf"hydra.run.dir={blocker}/run: cannot write there \(.*\); choose"):
        RunDirLock(blocker / "run").acquire()


def test_a_held_lock_is_detected_within_a_second(tmp_path):
    p = holder(tmp_path)
    try:
        t0 = time.monotonic()
        with pytest.raises(RunDirBusy):
            RunDirLock(tmp_path).acquire()
        assert time.monotonic() - t0 < 1.0
    finally:
        p.kill()
        p.wait()
