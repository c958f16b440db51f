"""A default run writes the same metrics as the golden run recorded before the worker was rebuilt from roles.

tests/data/golden/README.md says how the golden file was made. Every key it holds must be present and equal in a
new run with the same seed; timing and memory figures (`time/*`, `perf/*`, `memory/*`, seconds under `reshard/`)
are not part of a run's meaning and are not recorded. Keys added since may appear: they are listed, not compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_e2e import run_app

GOLDEN = Path(__file__).parent / "data" / "golden"


@pytest.mark.slow
def test_default_run_matches_the_golden_metrics(tmp_path):
    run_dir = tmp_path / "run"
    r = run_app(
        # Two intra-op threads, as torch chose on the 2-core machine that recorded it (a float sum's order
        # follows the thread count; the automatic choice for a tiny model is now one thread).
        ["model=hf", f"model.path={GOLDEN / 'tiny-qwen2'}", "trainer.steps=10", "trainer.eval_every=5", "cluster.cpu_threads=2",
         "logger.progress_bar=false", f"hydra.run.dir={run_dir}"],
        tmp_path, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    golden = [json.loads(line) for line in (GOLDEN / "metrics_10_steps.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [row["step"] for row in golden]
    for want, got in zip(golden, rows):
        for key, value in want.items():
            assert key in got, f"step {want['step']}: {key} missing"
            # float32 on the CPU, same operations in the same order: equal, not close.
            assert got[key] == value, f"step {want['step']}: {key} = {got[key]!r}, golden {value!r}"
