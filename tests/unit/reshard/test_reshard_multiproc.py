"""FSDP2 (gloo, 2 and 4 ranks) feeding engine TP 1, 2 and 4: every engine shard equals the reference, bit for bit.

Each world is started once (module fixture) and runs all its cases; each case is reported as its own test.
Ranks are forked from a forkserver that has torch and transformers imported already: spawning fresh
interpreters costs ~10 s of CPU per rank on these 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_harness import results_by_case, run_world
from tests.tiny_models import KINDS

pytestmark = pytest.mark.multiproc

HERE = Path(__file__).resolve().parent


def _cases(world: int) -> list[dict]:
    tps = [1, 2, 4] if world == 4 else [1, 2]
    cases = [dict(kind=k, style="fused", tp=tp, backend="copy") for k in KINDS for tp in tps]
    cases += [dict(kind=k, style="hf", tp=world, backend="copy") for k in KINDS]
    cases += [
        dict(kind="qwen2", style="fused", tp=2, backend="broadcast"),  # GQA kv head replicated over the group
        dict(kind="llama", style="hf", tp=2, backend="broadcast"),
        dict(kind="qwen3", style="fused", tp=2, backend="copy", dtype="bfloat16"),  # cast before the gather
    ]
    if world == 4:
        cases.append(dict(kind="llama", style="fused", tp=4, backend="broadcast"))
        cases.append(dict(kind="qwen2", style="fused", tp=2, backend="copy", fsdp="hsdp"))
    else:
        # rank 0 holds a plain model and feeds rank 1, which has none
        cases.append(
            dict(kind="qwen3", style="fused", tp=2, backend="broadcast", fsdp=None, receivers_without_model=True)
        )
        cases.append(dict(kind="llama", style="fused", tp=2, backend="copy", fsdp="shard1"))
    for c in cases:
        tags = [c.get("dtype"), "nomodel" if c.get("receivers_without_model") else None, c.get("fsdp")]
        c["id"] = "-".join([str(c[k]) for k in ("kind", "style", "tp", "backend")] + [t for t in tags if t])
    return cases


def _run_world(world: int, tmp: Path, timeout: float = 150.0) -> dict[str, list[str]]:
    """Run all cases of one world; returns {case id: [result per rank]}."""
    cases = _cases(world)
    return results_by_case(run_world(HERE / "_reshard_dist_worker.py", world, tmp, dict(cases=cases), timeout), cases)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _run_world(2, tmp_path_factory.mktemp("world2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _run_world(4, tmp_path_factory.mktemp("world4"))


@pytest.mark.parametrize("case", [c["id"] for c in _cases(2)])
def test_fsdp2_ranks(world2, case):
    assert world2[case] == ["ok"] * 2, "\n".join(world2[case])


@pytest.mark.parametrize("case", [c["id"] for c in _cases(4)])
def test_fsdp4_ranks(world4, case):
    assert world4[case] == ["ok"] * 4, "\n".join(world4[case])
