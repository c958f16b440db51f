"""Ulysses sequence parallelism across processes equals sequence parallel 1 (float32, CPU, gloo: 1e-5).

Worlds of 2 and 4 ranks build the run's roles (`build_components`) with `trainer.sequence_parallel_size` 2 or 4; each
rank takes its data-parallel shard of a ragged rollout (the same shard on every rank of an SP group) and computes
the log-probs, entropies and reference log-probs (or a critic's values) and one update's gradient. The reference is
the same config at sequence parallel 1 on one rank, built in this process: every rank's results must equal its rows
of the reference, the gathered gradient the reference's, and the update's metrics (averaged over the data-parallel
ranks as the controller does) the reference's. The models cover GQA whose KV heads divide by the degree and whose
KV heads do not (repeated): 2 query heads / 1 KV head at 2, 4 / 2 at 2 and at 4; a token budget (several
micro-batches), gradient checkpointing (the all-to-alls run again in the backward), the critic and LoRA.

One world per size for all its cases (a module fixture); each case is reported as its own test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridrl.algorithms import AlgorithmConfig
from hybridrl.algorithms.losses import LOSS_AGG_MODES
from hybridrl.batch import Batch
from hybridrl.config import RunConfig
from hybridrl.data.config import DataConfig
from hybridrl.models.config import LoraOptions, ModelConfig
from hybridrl.topology import Topology
from hybridrl.training.config import TrainerConfig
from hybridrl.training.critic_config import CriticConfig
from hybridrl.workers.build import Components, build_components
from hybridrl.workers.config import ClusterConfig
from tests.dist_harness import TORCH_PRELOAD, results_by_case, run_world
from tests.unit.training.test_packed_trainer import actor_pass, ragged_rollout, update_gradients

pytestmark = pytest.mark.multiproc

HERE = Path(__file__).resolve().parent
ROWS = 8


def _cases() -> list[dict]:
    cases = [dict(world=2, sp=2, model="h2kv1", role="actor", mode=mode) for mode in LOSS_AGG_MODES]
    cases += [
        dict(world=2, sp=2, model="h4kv2", role="actor", mode="seq-mean-token-sum", budget=24, checkpointing=True),
        dict(world=2, sp=2, model="h2kv1", role="critic", mode="seq-mean-token-mean"),
        dict(world=2, sp=2, model="h2kv1", role="lora", mode="token-mean"),
        dict(world=4, sp=4, model="h4kv2", role="actor", mode="seq-mean-token-mean"),
        dict(world=4, sp=2, model="h4kv2", role="actor", mode="token-mean", budget=24),
        dict(world=4, sp=2, model="h2kv1", role="critic", mode="token-mean", budget=24),
    ]
    for c in cases:
        tags = (f"-budget{c['budget']}" if "budget" in c else "") + ("-checkpointing" if c.get("checkpointing") else "")
        c["id"] = f"w{c['world']}-sp{c['sp']}-{c['model']}-{c['role']}-{c['mode']}{tags}"
    return cases


CASES = _cases()


def case_config(case: dict, models: dict, world: int) -> RunConfig:
    """The run config of `case` on `world` ranks (sequence parallel 1 when `world` is 1)."""
    sp = case["sp"] if world > 1 else 1
    algo = dict(group_size=2, loss_agg_mode=case["mode"], entropy_coef=0.01)
    critic = CriticConfig()
    if case["role"] == "critic":
        algo.update(name="ppo", lam=0.95, kl_in="reward", kl_estimator="k1")
        critic = CriticConfig(lr=1e-2)
    lora = LoraOptions(rank=4) if case["role"] == "lora" else LoraOptions()
    budget = dict(max_tokens_per_micro_batch=case["budget"]) if "budget" in case else dict(micro_batch_size=3)
    return RunConfig(
        model=ModelConfig(
            name="hf", path=models[case["model"]], lora=lora, gradient_checkpointing=case.get("checkpointing", False)
        ),
        trainer=TrainerConfig(lr=1e-2, sequence_parallel_size=sp, **budget),
        algorithm=AlgorithmConfig(**algo),
        critic=critic,
        data=DataConfig(train_batch_size=4),
        cluster=ClusterConfig(name="local" if world > 1 else "inline", workers_per_node=world),
    )


def rollout() -> Batch:
    """ROWS ragged rows (`ragged_rollout`) with returns for a critic's update."""
    batch = ragged_rollout(rows=ROWS)
    g = torch.Generator().manual_seed(7)
    batch["returns"] = torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"]
    return batch


def role_pass(case: dict, roles: Components, batch: Batch) -> dict:
    """What the case's role computes on `batch`: log-probs and the actor's update gradient, or values and the
    critic's update gradient."""
    if case["role"] != "critic":
        return actor_pass(roles, batch)
    values, _ = roles.critic.compute_values(roles.critic.micro_batches(batch))
    grads, metrics = update_gradients(roles.critic, Batch(batch.prompts, {**batch.tensors, **values}))
    return {**values, "grads": grads, "metrics": metrics}


@pytest.fixture(scope="module")
def models(_cache_dir, tiny_path) -> dict[str, str]:
    from hybridrl.models.tiny import ensure_tiny_model

    return {"h2kv1": tiny_path, "h4kv2": str(ensure_tiny_model(_cache_dir, num_heads=4, num_kv_heads=2))}


@pytest.fixture(scope="module")
def worlds(models, tmp_path_factory):
    """{world: (status per case, folder of the ranks' results)}, each world run once, on first use."""
    done: dict[int, tuple[dict, Path]] = {}

    def run(world: int) -> tuple[dict, Path]:
        if world not in done:
            cases = [c for c in CASES if c["world"] == world]
            tmp = tmp_path_factory.mktemp(f"seqpar{world}")
            args = dict(cases=cases, models=models)
            results = run_world(
                HERE / "_sequence_parallel_dist_worker.py",
                world,
                tmp,
                args,
                240.0 + 60 * world,
                preload=TORCH_PRELOAD + ["peft", "peft.tuners.lora"],
            )
            done[world] = (results_by_case(results, cases), tmp)
        return done[world]

    return run


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_sequence_parallel_equals_sequence_parallel_1(case, worlds, models, process_group):
    world, sp = case["world"], case["sp"]
    status, folder = worlds(world)
    assert status[case["id"]] == ["ok"] * world, "\n".join(status[case["id"]])
    cfg = case_config(case, models, 1)
    want = role_pass(case, build_components(cfg, cfg.topology(), torch.device("cpu"), with_engine=False), rollout())
    moved = [bool(g.abs().sum() > 0) for g in want["grads"].values()]
    assert moved and (any(moved) if case["role"] == "lora" else all(moved))  # LoRA's A gets none while B is 0
    topo = Topology(world, 1, 0, sp)
    got = {r: torch.load(folder / f"{case['id']}.rank{r}.pt") for r in range(world)}
    for r, out in got.items():
        rows = topo.dp_row_slices(ROWS)[topo.of_rank(r).dp_rank]
        keys = [k for k in ("old_logprobs", "entropy", "ref_logprobs", "values") if k in want]
        assert keys and all(k in out for k in keys), (keys, list(out))
        for key in keys:
            assert_close(out[key], want[key][rows], f"rank {r} {key}")
        assert out["grads"].keys() == want["grads"].keys()
        for name, g in want["grads"].items():
            assert_close(out["grads"][name], g, f"rank {r} gradient of {name}")
    # The controller averages a trainer phase's metrics over the data-parallel ranks (one result per SP group).
    leaders = [got[r]["metrics"] for r in topo.dp_leaders()]
    for key, value in want["metrics"].items():
        if key.startswith(("actor/", "critic/")) and not key.endswith("/lr"):
            mean = sum(m[key] for m in leaders) / len(leaders)
            assert mean == pytest.approx(value, rel=1e-5, abs=1e-7), key
