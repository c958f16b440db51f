"""FSDP2 over 2 and 4 gloo ranks feeding fused engines of TP 2 and 4 (kv heads replicated when tp > kv heads):
the resharder's verify passes, and the sharded engine's logits and log-probs equal the unsharded model's; at TP 2,
agent turns joining the leader's running batch one by one, replayed on the other rank (`lead`/`follow`).

Each world is started once (module fixture) and runs all its cases; each case is reported as its own test.
Ranks fork from a forkserver with torch and transformers imported already (fresh interpreters cost ~10 s of
CPU per rank on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_harness import results_by_case, run_world
from tests.tiny_models import KINDS

pytestmark = pytest.mark.multiproc

HERE = Path(__file__).resolve().parent


def _cases(world: int) -> list[dict]:
    if world == 2:
        cases = [dict(kind=k, tp=2) for k in KINDS]  # qwen2: its 1 kv head on both ranks
        cases += [dict(kind="qwen2", tp=1), dict(kind="qwen3", tp=2, sleep=True)]
        cases += [dict(kind="llama", tp=2, biases=True)]  # o/down biases added once, after the all-reduce
        cases += [dict(kind="qwen3", tp=2, lockstep=True)]  # agent turns: the leader's schedule, replayed
    else:
        cases = [dict(kind=k, tp=4) for k in KINDS]  # llama/qwen3: 2 kv heads over 4 ranks
        cases += [dict(kind="llama", tp=2)]  # two engine groups of 2 beside one FSDP mesh of 4
    for c in cases:
        tags = ["sleep" if c.get("sleep") else "", "bias" if c.get("biases") else ""]
        tags.append("lockstep" if c.get("lockstep") else "")
        c["id"] = "-".join([c["kind"], f"tp{c['tp']}", *filter(None, tags)])
    return cases


def _run_world(world: int, tmp: Path, timeout: float = 300.0) -> dict[str, list[str]]:
    """Run all cases of one world; returns {case id: [result per rank]}."""
    cases = _cases(world)
    return results_by_case(run_world(HERE / "_fused_dist_worker.py", world, tmp, dict(cases=cases), timeout), cases)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _run_world(2, tmp_path_factory.mktemp("fused-world2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _run_world(4, tmp_path_factory.mktemp("fused-world4"))


@pytest.mark.parametrize("case", [c["id"] for c in _cases(2)])
def test_fused_tp_world2(world2, case):
    assert world2[case] == ["ok"] * 2, "\n".join(world2[case])


@pytest.mark.parametrize("case", [c["id"] for c in _cases(4)])
def test_fused_tp_world4(world4, case):
    assert world4[case] == ["ok"] * 4, "\n".join(world4[case])
