"""Checkpoints: atomic publication, resume after SIGKILL with identical metrics, export to HF."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.checkpoints import CheckpointDir
from hybridrl.errors import ConfigError
from tests.paths import TESTS

ARGS = [
    "data.train_batch_size=4",
    "algorithm.group_size=4",
    "logger.progress_bar=false",
    "trainer.save_every=3",
    "trainer.steps=6",
]


def volatile(key: str) -> bool:
    """Wall-clock and memory figures legitimately differ between runs; everything else must match."""
    return key.startswith(("time/", "perf/", "memory/")) or key.endswith(("_s", "seconds", "_gbps", "per_s"))


FAULTS = TESTS / "faults"  # the test-only fault hook (tests/faults/sitecustomize.py)


def app(args: list[str], cwd: Path, fault: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if fault:
        env["HYBRIDRL_TEST_FAULT"] = fault
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", "hybridrl", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def kill_and_resume(args: list[str], tmp_path: Path) -> tuple[list[dict], list[dict], str]:
    """Run `args` straight through, then again killed (SIGKILL) right after step 4 is logged and resumed with
    `trainer.resume=auto`; returns (straight rows, resumed rows, the resumed run's output). `args` must save every
    3 steps of 6: the newest checkpoint at the kill is step 3, and step 4's row must be redone. The kill comes from
    inside, at step 5's wake-up (the fault hook): a SIGKILL sent from here once step 4's row appeared raced a fast
    run to its end (seen in CI: the run had saved step 6)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    p = app([*args, f"hydra.run.dir={straight}"], tmp_path)
    assert p.wait(timeout=600) == 0, p.stdout.read()[-3000:]

    p = app([*args, f"hydra.run.dir={resumed}"], tmp_path, fault="0:wake:5:kill")
    assert p.wait(timeout=600) == -signal.SIGKILL, p.stdout.read()[-3000:]
    assert len(rows(resumed)) == 4
    assert (resumed / "checkpoints" / "step_000003" / "meta.json").exists()
    assert not (resumed / "checkpoints" / "step_000006").exists()

    p = app([*args, "trainer.resume=auto", f"hydra.run.dir={resumed}"], tmp_path)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:]
    assert "resumed from" in out and "at step 3" in out
    return rows(straight), rows(resumed), out


def assert_same_metrics(a: list[dict], b: list[dict]) -> None:
    """Every non-volatile metric of every step equal (float32 on CPU: bit-identical in practice; allow rounding)."""
    assert [r["step"] for r in b] == [r["step"] for r in a]  # no duplicated or missing steps
    for x, y in zip(a, b):
        for key, value in x.items():
            if volatile(key) or value is None:
                continue
            assert y[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (x["step"], key)


@pytest.mark.slow
def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path):
    a, b, _ = kill_and_resume(ARGS, tmp_path)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert_same_metrics(a, b)
    assert sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()) == ["step_000003", "step_000006"]


def test_incomplete_checkpoints_are_never_resumed(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep_last=2)
    for step in (3, 6):
        tmp = ckpt.staging(step)
        (tmp / "payload").write_text("x")
        ckpt.publish(tmp, step, {"loader": {}})
    # Killed mid-save: a staging folder, and a step folder whose meta.json was never written.
    (ckpt.staging(9) / "payload").write_text("half")
    (ckpt.root / "step_000012").mkdir()
    assert ckpt.resolve("auto") == ckpt.root / "step_000006"
    assert not list(ckpt.root.glob(".tmp-*"))  # the half-written staging folder was cleaned up


def test_keep_last_prunes_older_checkpoints(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        ckpt.publish(ckpt.staging(step), step, {})
    assert [s for s, _ in ckpt.complete()] == [2, 3]


def test_resume_from_a_path_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="trainer.resume"):
        CheckpointDir(tmp_path, 1).resolve(str(tmp_path))
    assert CheckpointDir(tmp_path, 1).resolve("auto") is None


def test_export_hf_writes_the_trained_weights(tmp_path, tiny_path, tokenizer, process_group):
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from hybridrl.config import RunConfig
    from hybridrl.export import main as export_main
    from hybridrl.models.config import ModelConfig
    from hybridrl.workers.build import build_components

    cfg = RunConfig(model=ModelConfig(name="hf", path=tiny_path))
    trainer = build_components(cfg, cfg.topology(), torch.device("cpu")).actor
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.5)  # stands in for training: the export must carry these weights, not the base ones
    ckpt = CheckpointDir(tmp_path, 1)
    tmp = ckpt.staging(1)
    trainer.save(str(tmp))
    path = ckpt.publish(tmp, 1, {"loader": {}, "config": OmegaConf.to_container(OmegaConf.structured(cfg))})
    assert export_main(["--checkpoint", str(path), "--output", str(tmp_path / "hf"), "--model-path", tiny_path]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for name, full in trainer.iter_full_params():
        assert torch.equal(exported.state_dict()[name], full), name
    assert (tmp_path / "hf" / "tokenizer_config.json").exists()
    with pytest.raises(SystemExit, match="exists"):
        export_main(["--checkpoint", str(path), "--output", str(tmp_path / "hf"), "--model-path", tiny_path])
