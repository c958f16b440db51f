"""Divergence, save failures, edited checkpoints and slow dependencies in real runs (`python -m hybridrl` in a
subprocess): trainer.lr=1e10 fresh and resumed, a full disk inside the distributed checkpoint, an edited meta.json,
a reward function slow on every sample, a remote reward that drips its answer, a phase that hangs with cluster=inline.

    .venv/bin/python -m pytest -q -m faults tests/integration/test_trust_failures.py
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time

import pytest

from hybridrl.checkpoints import verify
from tests.integration.test_cluster import FAULTS
from tests.integration.test_trust_faults import FAST, console_lines, run_app, steps
from tests.paths import REPO

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def errors(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in console_lines(r) if "ERROR" in line]


def checkpoints(run) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").is_dir() else []


def test_lr_1e10_fresh_stops_before_anything_is_saved(tmp_path):
    run = tmp_path / "run"
    r = run_app([*FAST, "trainer.steps=3", "trainer.save_every=1", "trainer.lr=1e10", f"hydra.run.dir={run}"], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    [line] = errors(r)
    assert "error: actor: one optimizer step changed the trained parameters' norm from " in line
    assert line.endswith("resume from the last checkpoint with a lower trainer.lr (in step 1)"), line
    assert "Traceback" not in out and "index -1 is out of bounds" not in out
    assert checkpoints(run) == []  # the diverged step was never written
    assert not (run / "metrics.jsonl").exists() or steps(run) == []


def test_lr_1e10_resumed_keeps_the_good_checkpoint_and_writes_no_diverged_one(tmp_path):
    run = tmp_path / "run"
    common = [*FAST, "trainer.save_every=1", "trainer.keep_last=1", f"hydra.run.dir={run}"]
    r = run_app([*common, "trainer.steps=2"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert checkpoints(run) == ["step_000002"]
    r = run_app([*common, "trainer.steps=4", "trainer.resume=auto", "trainer.lr=1e10"], tmp_path)
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert "(in step 3)" in errors(r)[0] and "training diverged" in errors(r)[0]
    assert checkpoints(run) == ["step_000002"]  # not pruned for a diverged step_000003
    verify(run / "checkpoints" / "step_000002")
    assert steps(run) == [1, 2]
    r = run_app([*common, "trainer.steps=4", "trainer.resume=auto"], tmp_path)  # the next resume picks the good one
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout + r.stderr and steps(run) == [1, 2, 3, 4]


def mount_tmpfs(where, options: str) -> bool:
    """Mount a tmpfs at `where` with `options`; False where this machine does not allow it (not root, no mount)."""
    try:
        return (
            subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True).returncode
            == 0
        )
    except OSError:
        return False


def _full_disk_hooks(tmp_path) -> dict[str, str]:
    """Where mounting is not allowed: DCP's writes go to /dev/full (each fails with ENOSPC, a real OS error)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "from contextlib import contextmanager\n"
        "import torch.distributed.checkpoint.filesystem as fs\n"
        "@contextmanager\n"
        "def create_stream(self, path, mode):\n"
        "    with open('/dev/full' if 'w' in mode else path, mode) as stream:\n"
        "        yield stream\n"
        "fs.FileSystem.create_stream = create_stream\n"
    )
    return {"PYTHONPATH": str(hooks)}


def test_a_full_disk_inside_the_distributed_checkpoint_is_one_line_exit_2(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    # A 256 KiB disk for the checkpoints (one is ~1.7 MB) where the machine lets us mount one.
    mounted = mount_tmpfs(run / "checkpoints", "size=256k")
    env = {} if mounted else _full_disk_hooks(tmp_path)
    try:
        r = run_app([*FAST, "trainer.steps=2", "trainer.save_every=1", f"hydra.run.dir={run}"], tmp_path, env=env)
        left = sorted(p.name for p in (run / "checkpoints").iterdir())
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(run / "checkpoints")], capture_output=True)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    [line] = errors(r)
    assert "error: checkpoint step_000001: cannot write dcp" in line
    assert "No space left on device [errno 28]; the checkpoint was not kept" in line and line.endswith("(in step 1)")
    assert "Traceback" not in out and "CheckpointException" not in out
    assert line.split("] - ", 1)[1] in (run / "hybridrl.log").read_text()  # the log has it too
    assert left == []  # no .tmp-step_000001, nothing that looks complete


def test_an_edited_meta_json_is_refused_or_skipped(tmp_path):
    run = tmp_path / "run"
    common = [*FAST, "trainer.steps=4", "trainer.save_every=2", "trainer.keep_last=2", f"hydra.run.dir={run}"]
    r = run_app(common, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    newest = run / "checkpoints" / "step_000004"
    meta = json.loads((newest / "meta.json").read_text())
    meta["step"] = 6  # the edit: a later step, two steps missing from the metrics
    (newest / "meta.json").write_text(json.dumps(meta, indent=1))

    r = run_app([*FAST, "trainer.steps=8", f"trainer.resume={newest}", f"hydra.run.dir={tmp_path / 'b'}"], tmp_path)
    assert r.returncode == 2
    [line] = errors(r)
    assert line.endswith(f"error: checkpoint {newest}: meta.json fails its sha256 check (edited after it was written)")

    r = run_app([*common, "trainer.resume=auto"], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "skipping step_000004" in out and "meta.json fails its sha256 check" in out
    assert "at step 2" in out and steps(run) == [1, 2, 3, 4]


def test_a_reward_function_slow_on_every_sample_stops_within_its_deadline(tmp_path):
    t0 = time.monotonic()
    r = run_app(
        [
            *FAST,
            "trainer.steps=2",
            "reward.fn=tests.helpers.slow_rewards:slow",
            "reward.timeout_s=2",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        REPO,
    )
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert time.monotonic() - t0 < 150  # 16 samples x 30 s on 8 threads would be a minute per step, unbounded
    [line] = errors(r)
    assert (
        "error: reward function tests.helpers.slow_rewards:slow did not return within reward.timeout_s=2 s on 16 of "
        "16 samples; first: RewardTimeout: no result within reward.timeout_s=2 s" in line
    )
    assert line.endswith("That is more than reward.max_error_frac=0.25: fix the function (in step 1)")


def test_a_remote_reward_that_drips_its_answer_cannot_hold_an_inline_run(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=drip, args=(conn,), daemon=True).start()

    def drip(conn) -> None:
        try:
            conn.recv(1 << 20)
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b" " * 100:
                if stop.wait(0.5):
                    return
                conn.sendall(bytes([byte]))
        except OSError:
            pass
        finally:
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}/score"
    try:
        t0 = time.monotonic()
        r = run_app(
            [
                *FAST,
                "trainer.steps=2",
                "reward=remote",
                f"reward.remote.url={url}",
                "reward.remote.timeout_s=3",
                "reward.remote.max_retries=1",
                "reward.remote.backoff_s=0",
                f"hydra.run.dir={tmp_path / 'run'}",
            ],
            tmp_path,
        )
        took = time.monotonic() - t0
    finally:
        stop.set()
        server.close()
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert took < 150
    [line] = errors(r)
    assert f"error: reward.remote.url={url}: no answer within reward.remote.timeout_s=3 s" in line
    assert "(gave up after 2 attempts)" in line


def test_a_hung_phase_with_cluster_inline_is_named_within_the_deadline(tmp_path):
    env = {"HYBRIDRL_TEST_FAULT": "0:reward:1:hang", "PYTHONPATH": str(FAULTS)}
    r = run_app(
        [*FAST, "trainer.steps=2", "cluster.collective_timeout_s=3", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
        env=env,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    [line] = errors(r)
    assert re.search(
        r"error: worker rank 0 timed out during 'reward' \(no answer after [89]s; cluster.collective_timeo", line
    )
    assert "Traceback" not in out
