"""LoRA through the resharder across processes: FSDP2 over 2 ranks (gloo) with PEFT adapters, one optimizer step,
then engine TP 1 and 2. Every engine shard equals PEFT's own merge of the trained weights (float32: 1e-6).

One world for all cases (module fixture); each case is reported as its own test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_harness import results_by_case, run_world
from tests.tiny_models import KINDS

pytestmark = pytest.mark.multiproc

HERE = Path(__file__).resolve().parent
PRELOAD_PEFT = ["peft", "peft.tuners.lora"]


def _cases() -> list[dict]:
    cases = [dict(kind=k, style="fused", tp=tp, backend="copy") for k in KINDS for tp in (1, 2)]
    cases += [
        dict(kind="llama", style="hf", tp=2, backend="copy"),
        dict(kind="qwen2", style="fused", tp=2, backend="broadcast"),
        dict(kind="qwen3", style="fused", tp=2, backend="copy", dtype="bfloat16"),  # cast before the gather and merge
    ]
    for c in cases:
        tags = [c["dtype"]] if "dtype" in c else []
        c["id"] = "-".join([str(c[k]) for k in ("kind", "style", "tp", "backend")] + tags)
    return cases


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    from tests.dist_harness import TORCH_PRELOAD

    cases = _cases()
    results = run_world(
        HERE / "_lora_dist_worker.py",
        2,
        tmp_path_factory.mktemp("lora2"),
        dict(cases=cases),
        240.0,
        preload=TORCH_PRELOAD + PRELOAD_PEFT,
    )
    return results_by_case(results, cases)


@pytest.mark.parametrize("case", [c["id"] for c in _cases()])
def test_engine_shards_equal_peft_merged_weights(world2, case):
    assert world2[case] == ["ok"] * 2, "\n".join(world2[case])
