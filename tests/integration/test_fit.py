"""A run that will not fit its device stops before any weights load, with one line naming the shortfall and what
fits (a pretend device size on the CPU: `trainer.device_memory_gb`)."""

from __future__ import annotations

from tests.integration.test_e2e import run_app


def test_a_run_that_does_not_fit_exits_2_before_loading_weights(tmp_path):
    args = ["trainer.device_memory_gb=1.1", "model.tiny.pretrain_steps=0", f"hydra.run.dir={tmp_path / 'run'}"]
    r = run_app(args, tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    lines = [line for line in out.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, out[-3000:]
    line = lines[0]
    assert "in its update phase" in line and "GiB more than the" in line
    assert "these fit: " in line and "model.gradient_checkpointing=true" in line
    # Nothing was loaded: no worker started, no weights read.
    assert "Loading weights" not in out and "training prompts" not in out
