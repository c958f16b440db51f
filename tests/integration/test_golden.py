"""A default run writes the same metrics as the golden run (first recorded before the worker was rebuilt from roles).

tests/data/golden/README.md says how the golden file was made, and when and why it was re-recorded. Every key it
holds must be present and equal in a new run with the same seed; timing and memory figures (`time/*`, `perf/*`,
`memory/*`, seconds under `reshard/`) are not part of a run's meaning and are not recorded. Keys added since may
appear: they are listed, not compared.

Equal means: the same integers, strings and sampled tokens' rewards, and floats within float32 rounding. On the CPU
model that recorded the file the run is bit for bit the same; on another (an AMD EPYC, where torch's BLAS kernels
sum in another order) the losses, KL and gradient norms of ten steps differed in the 7th significant digit and the
engine-vs-trainer log-prob mismatch (`mismatch/*`, itself a measure of rounding: ~2e-7) by up to 10% of its value.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.integration.test_e2e import run_app
from tests.paths import TESTS

GOLDEN = TESTS / "data" / "golden"


@pytest.mark.slow
def test_default_run_matches_the_golden_metrics(tmp_path):
    run_dir = tmp_path / "run"
    r = run_app(
        # Two intra-op threads, as torch chose on the 2-core machine that recorded it (a float sum's order
        # follows the thread count; the automatic choice for a tiny model is now one thread).
        [
            "model=hf",
            f"model.path={GOLDEN / 'tiny-qwen2'}",
            "trainer.steps=10",
            "trainer.eval_every=5",
            "cluster.cpu_threads=2",
            "logger.progress_bar=false",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    golden = [json.loads(line) for line in (GOLDEN / "metrics_10_steps.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [row["step"] for row in golden]
    for want, got in zip(golden, rows):
        for key, value in want.items():
            assert key in got, f"step {want['step']}: {key} missing"
            assert same(key, value, got[key]), (
                f"step {want['step']}: {key} = {got[key]!r}, golden {value!r} (if a change meant to alter the run, "
                "e.g. the sampler's draws, re-record as tests/data/golden/README.md says, after checking that "
                "nothing else moved)"
            )


def same(key: str, want: object, got: object) -> bool:
    """Equal, floats within float32 rounding (see the module doc): 1e-5 relative, which any change of an algorithm's
    math exceeds; the rounding-noise measures `mismatch/*` within 1e-5 absolute (their threshold for counting a
    token as mismatched is orders of magnitude above)."""
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        if key.startswith("mismatch/"):
            return abs(got - want) <= 1e-5
        return math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-12)
    return got == want
