"""Two ranks (gloo, CPU, float32): `FSDPLearner` with the moments on the host steps exactly as with the ordinary
AdamW, over FSDP2 shards of uneven size, gradient clipping by the global norm and weight decay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_harness import results_by_case, run_world

pytestmark = pytest.mark.multiproc

HERE = Path(__file__).resolve().parent
CASES = [dict(id="ordinary", on_host=False), dict(id="on_host", on_host=True)]


def test_two_ranks_step_as_the_ordinary_optimizer(tmp_path):
    results = run_world(HERE / "_host_optimizer_dist_worker.py", 2, tmp_path, dict(cases=CASES), 180.0)
    assert results_by_case(results, CASES) == {c["id"]: ["ok", "ok"] for c in CASES}
    runs = {(c["id"], r): torch.load(tmp_path / f"{c['id']}.rank{r}.pt") for c in CASES for r in range(2)}
    want = runs["ordinary", 0]
    assert all(torch.equal(want[n], runs["ordinary", 1][n]) for n in want)  # every rank gathers the same model
    for r in range(2):
        got = runs["on_host", r]
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)
