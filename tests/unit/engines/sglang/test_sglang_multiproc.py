"""SglangEngine's rank choreography on CPU (gloo): 2 ranks at TP 2, 4 ranks at TP 4 and at TP 2 (two groups).

A stand-in engine on each TP leader records every call. Checked: every rank gets exactly its own completions (of
prompts, and of requests: agent turns go one batch per turn through the leader at TP > 1, or one by one through the
leader's request API inside `lead`); identical calls of a group are generated once; the leader receives one weight
payload per TP rank per push, in TP-rank order; the engine sees sleep/wake/session calls in the documented order; no
rank leaves sleep before the leader's release finished, and the leader resumes only after every rank entered
wake_up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist_harness import run_world

pytestmark = pytest.mark.multiproc

HERE = Path(__file__).resolve().parent
WORLDS = [(2, 2), (4, 4), (4, 2)]

LEADER_CALLS = [
    "__init__",
    "generate",
    "generate",
    "generate",  # agent turns outside `lead`: one batch per turn
    "async_generate",  # inside `lead`: one by one, the leader's own
    "async_generate",
    "async_generate",  # a partial rollout: the group's requests once, through the request API
    "async_generate",
    "async_generate",
    "async_generate",
    "release_memory_occupation",
    "resume_memory_occupation",
    "begin_weight_update",
    "update_weights_from_tensor",
    "update_weights_from_tensor",
    "end_weight_update",
    "flush_cache",
    "resume_memory_occupation",
    "generate",
    "release_memory_occupation",
    "resume_memory_occupation",
    "begin_weight_update",
    "update_weights_from_tensor",
    "end_weight_update",  # refused push, session closed
    "begin_weight_update",
    "update_weights_from_tensor",
    "end_weight_update",
    "flush_cache",
    "resume_memory_occupation",
    "generate",
    "shutdown",
]


def _run_world(world: int, tp: int, tmp: Path, timeout: float = 120.0) -> dict[int, dict]:
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    args = dict(tp=tp, model_dir=str(tmp / "model"))
    return run_world(HERE / "_sglang_dist_worker.py", world, tmp, args, timeout, preload=["torch", "torch.distributed"])


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}-tp{t}" for w, t in WORLDS])
def world(request, tmp_path_factory):
    w, tp = request.param
    return w, tp, _run_world(w, tp, tmp_path_factory.mktemp(f"w{w}tp{tp}"))


def test_every_rank_gets_its_own_outputs(world):
    _, _, results = world
    bad = [msg for res in results.values() for msg in res["checks"].values() if msg != "ok"]
    assert not bad, "\n".join(bad)
    assert all(
        set(res["checks"])
        == {"distinct", "identical", "turns", "streamed", "partial", "after_sync", "refused", "final", "leader"}
        for res in results.values()
    )


def test_leader_call_order_and_request_counts(world):
    w, tp, results = world
    for leader in range(0, w, tp):
        calls = results[leader]["calls"]
        assert [c[0] for c in calls] == LEADER_CALLS
        kwargs = calls[0][1]
        assert kwargs["tp_size"] == tp and kwargs["skip_tokenizer_init"] is True
        gens = [len(c[1]["input_ids"]) for c in calls if c[0] == "generate"]
        assert gens == [tp * 2 * 2, 2 * 3, tp * 2, tp * 2, tp * 2]  # the identical call is generated once, not tp times
        tags = [c[1]["tags"] for c in calls if c[0].endswith("memory_occupation")]
        assert tags == [None, ["weights"], ["kv_cache", "cuda_graph"], None, ["weights"], ["kv_cache", "cuda_graph"]]
        pushes = [c[1] for c in calls if c[0] == "update_weights_from_tensor"]
        assert all(
            p == {"named_tensors": f"{tp} payloads", "load_format": "flattened_bucket", "flush_cache": False}
            for p in pushes
        )
    for r in range(w):
        if r % tp:
            assert "calls" not in results[r]  # only leaders own an engine


def test_one_payload_per_tp_rank_in_rank_order(world):
    w, tp, results = world
    for leader in range(0, w, tp):
        pushes = results[leader]["pushes"]
        assert len(pushes) == 4
        q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
        assert pushes[0] == [
            [[q, "torch.float32", [4, 3], float(leader + r)], [k, "torch.bfloat16", [2, 3], float(leader + r)]]
            for r in range(tp)
        ]
        assert pushes[1] == [[["model.norm.weight", "torch.float32", [3], leader + r + 0.5]] for r in range(tp)]
        assert pushes[3] == [[["model.norm.weight", "torch.float32", [3], leader + r + 0.25]] for r in range(tp)]


def test_sleep_and_wake_wait_for_the_group(world):
    w, tp, results = world
    for leader in range(0, w, tp):
        calls = results[leader]["calls"]
        release_end = next(c[3] for c in calls if c[0] == "release_memory_occupation")
        resume_start = next(c[2] for c in calls if c[0] == "resume_memory_occupation")
        group = range(leader, leader + tp)
        assert min(results[r]["sleep_returned"] for r in group) >= release_end
        assert resume_start >= max(results[r]["wake_entered"] for r in group)
