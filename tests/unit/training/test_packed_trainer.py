"""Packed and token-budgeted passes through the roles a run builds, against the padded path they replace.

The reference is `trainer.padding_free=false` with row micro-batches: the right-padded [rows, longest] forwards the
trainer ran before packing. On the CPU in float32 the log-probs, entropies, values and the gradient of one update
must agree to 1e-5 for every loss aggregation, with the critic and with LoRA, whatever the micro-batch split."""

from __future__ import annotations

import pytest
import torch

from hybridrl.algorithms import AlgorithmConfig
from hybridrl.algorithms.losses import LOSS_AGG_MODES
from hybridrl.batch import Batch
from hybridrl.config import RunConfig
from hybridrl.data.config import DataConfig
from hybridrl.models.config import LoraOptions, ModelConfig
from hybridrl.training.config import TrainerConfig
from hybridrl.training.critic_config import CriticConfig
from hybridrl.workers.build import Components, build_components

PADDED = dict(padding_free=False, micro_batch_size=3)
LAYOUTS = {
    "packed_rows": dict(micro_batch_size=3),
    "packed_budget": dict(max_tokens_per_micro_batch=40),
    "packed_whole": dict(micro_batch_size=8),
    "model_attention": dict(micro_batch_size=3, packed_attention="model"),
}


def ragged_rollout(seed: int = 0, rows: int = 8, width: int = 12) -> Batch:
    """Prompts of 3-9 tokens, responses of 1-12 (garbage ids past each row's end), advantages, rollout log-probs."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, 60, (int(n),), generator=g).tolist() for n in torch.randint(3, 10, (rows,), generator=g)
    ]
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[0] = width  # one row at the limit
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    responses = torch.randint(3, 60, (rows, width), generator=g)
    return Batch(
        prompts,
        {
            "responses": responses,
            "response_mask": mask,
            "advantages": torch.randn(rows, generator=g)[:, None].expand(rows, width) * mask,
        },
    )


def build(tiny_path, mode="token-mean", algo=None, model=None, critic=None, **trainer) -> Components:
    cfg = RunConfig(
        model=model or ModelConfig(name="hf", path=tiny_path),
        trainer=TrainerConfig(lr=1e-2, **trainer),
        algorithm=AlgorithmConfig(group_size=4, loss_agg_mode=mode, entropy_coef=0.01, **(algo or {})),
        critic=critic or CriticConfig(),
        data=DataConfig(train_batch_size=2),
    )
    return build_components(cfg, cfg.topology(), torch.device("cpu"), with_engine=False)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def update_gradients(learner, batch: Batch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The gradient of one update (what the optimizer step would apply), and the update's metrics."""
    grads: dict[str, torch.Tensor] = {}
    step = learner.optimizer.step

    def record(*args, **kwargs):
        for name, p in learner.model.named_parameters():
            if p.grad is not None:
                grads[name] = full(p.grad)
        return step(*args, **kwargs)

    learner.optimizer.step = record
    try:
        metrics = learner.update(batch)
    finally:
        learner.optimizer.step = step
    return grads, metrics


def actor_pass(roles: Components, batch: Batch) -> dict:
    """Log-probs, entropies and reference log-probs of `batch`, then the gradient of one actor update on it."""
    batch = Batch(batch.prompts, dict(batch.tensors))
    micro = roles.actor.micro_batches(batch)
    out = roles.actor.compute_logprobs(micro)
    if roles.ref is not None:
        out.update(roles.ref.compute_logprobs(micro))
    elif roles.actor.serves_reference:
        out.update(roles.actor.compute_ref_logprobs(micro))
    for k, v in out.items():
        batch[k] = v
    # A slightly different old policy, so ratios and the KL are not all 1 and 0.
    batch["old_logprobs"] = out["old_logprobs"] + 0.05 * batch["response_mask"]
    grads, metrics = update_gradients(roles.actor, batch)
    return {**out, "grads": grads, "metrics": metrics}


def assert_same(got: dict, want: dict, atol: float = 1e-5) -> None:
    for key in ("old_logprobs", "entropy", "ref_logprobs", "values"):
        if key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=atol, msg=key)
    assert got["grads"].keys() == want["grads"].keys() and want["grads"]
    for name, g in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_packed_update_equals_the_padded_one_for_every_loss_aggregation(tiny_path, process_group, mode):
    batch = ragged_rollout()
    want = actor_pass(build(tiny_path, mode, **PADDED), batch)
    assert want["grads"] and all(g.abs().sum() > 0 for g in want["grads"].values())
    for name, layout in LAYOUTS.items():
        got = actor_pass(build(tiny_path, mode, **layout), batch)
        assert_same(got, want)
        for key in ("actor/pg_loss", "actor/kl", "actor/grad_norm"):
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-7), (name, key)


def test_pad_frac_counts_the_positions_each_layout_computes(tiny_path, process_group):
    batch = ragged_rollout()
    lengths = [len(p) + int(n) for p, n in zip(batch.prompts, batch["response_mask"].sum(-1))]
    # Padded, 3 rows a micro-batch: each computes rows x its longest row; log-prob pass, reference pass, update.
    computed = sum(len(lengths[s : s + 3]) * max(lengths[s : s + 3]) for s in range(0, 8, 3))
    padded = actor_pass(build(tiny_path, **PADDED), batch)["metrics"]
    assert padded["perf/pad_frac"] == pytest.approx(1 - sum(lengths) / computed)
    packed = actor_pass(build(tiny_path, **LAYOUTS["packed_budget"]), batch)["metrics"]
    n_micro = -(-sum(lengths) // 40)
    # Packed: only the tail that rounds each micro-batch up to a multiple of 8 (< 8 positions each).
    assert 0 <= packed["perf/pad_frac"] < 1 - sum(lengths) / (sum(lengths) + 7 * (n_micro + 1))
    assert packed["perf/trainer_tokens_per_s"] > 0 and packed["trainer/compiles"] >= 0


def test_token_budget_micro_batches_stay_within_it_and_balance(tiny_path, process_group):
    roles = build(tiny_path, **LAYOUTS["packed_budget"])
    batch = ragged_rollout(rows=8)
    micro = roles.actor.micro_batches(batch)
    lengths = [len(p) + int(n) for p, n in zip(batch.prompts, batch["response_mask"].sum(-1))]
    sizes = [m.real_tokens for m in micro]
    assert sorted(r for m in micro for r in m.rows) == list(range(8))  # every row once
    assert sum(sizes) == sum(lengths) and all(s <= 40 for s in sizes)
    assert len(micro) in (-(-sum(lengths) // 40), -(-sum(lengths) // 40) + 1)  # the fewest, or one more to fit
    assert max(sizes) - min(sizes) <= max(lengths)  # balanced: loads differ by less than one row


def test_packed_values_and_critic_update_equal_the_padded_ones(tiny_path, process_group):
    ppo = dict(name="ppo", lam=0.95, kl_in="reward", kl_estimator="k1")
    batch = ragged_rollout()
    results = {}
    for name, layout in {"padded": PADDED, **{k: LAYOUTS[k] for k in ("packed_rows", "packed_budget")}}.items():
        roles = build(tiny_path, "seq-mean-token-mean", algo=ppo, critic=CriticConfig(lr=1e-2), **layout)
        values, _ = roles.critic.compute_values(roles.critic.micro_batches(batch))
        b = Batch(batch.prompts, {**batch.tensors, **values, "returns": torch.randn(8, 12) * batch["response_mask"]})
        grads, metrics = update_gradients(roles.critic, b)
        results[name] = {"values": values["values"], "grads": grads, "metrics": metrics}
    want = results.pop("padded")
    assert (want["values"][batch["response_mask"] == 0] == 0).all()
    for got in results.values():
        assert_same(got, want)
        assert got["metrics"]["critic/value_loss"] == pytest.approx(want["metrics"]["critic/value_loss"], rel=1e-5)


def test_packed_lora_equals_padded_lora(tiny_path, process_group):
    lora = ModelConfig(name="hf", path=tiny_path, lora=LoraOptions(rank=4))
    batch = ragged_rollout()
    want = actor_pass(build(tiny_path, model=lora, **PADDED), batch)
    assert "ref_logprobs" in want and all("lora_" in n for n in want["grads"])
    for layout in ("packed_rows", "packed_budget"):
        assert_same(actor_pass(build(tiny_path, model=lora, **LAYOUTS[layout]), batch), want)


def test_packed_reward_model_scores_equal_the_padded_ones(_cache_dir, process_group):
    """Reward models pack their own token path too; the padded path (trainer.padding_free=false) is the reference,
    and both equal one unpadded forward per sequence (tests/unit/rewards/test_reward_models.py)."""
    from hybridrl.models.tiny_heads import ensure_tiny_reward_model
    from hybridrl.rewards.reward_model import RewardModel, RewardModelConfig
    from hybridrl.topology import Topology
    from hybridrl.training.fsdp import Precision
    from tests.unit.rewards.test_reward_models import ITEMS

    path = str(ensure_tiny_reward_model(_cache_dir, seed=1))
    scores = {}
    for padding_free in (False, True):
        rm = RewardModel(
            RewardModelConfig(name="rm", micro_batch_size=3),
            path,
            torch.device("cpu"),
            Topology(1, 1, 0).fsdp_mesh("cpu"),
            Precision.for_device("auto", torch.device("cpu")),
            padding_free=padding_free,
        )
        assert rm.packed == padding_free
        scores[padding_free] = rm.score(ITEMS * 3)
    assert scores[True] == pytest.approx(scores[False], rel=1e-5, abs=1e-6)
    assert len(set(round(s, 4) for s in scores[True])) == 3


def test_a_long_sequence_over_the_budget_trains_alone_and_exactly(tiny_path, process_group):
    """Long contexts keep working packed: a 480-token row beside short ones under a 96-token budget runs as a
    micro-batch of its own, never cut, and the update equals the padded one."""
    batch = ragged_rollout(rows=8, width=12)
    long_prompt = torch.randint(3, 60, (180,), generator=torch.Generator().manual_seed(5)).tolist()
    width = 300
    tensors = {k: torch.nn.functional.pad(v, (0, width - v.shape[1])) for k, v in batch.tensors.items()}
    tensors["responses"][3] = torch.randint(3, 60, (width,), generator=torch.Generator().manual_seed(6))
    tensors["response_mask"][3] = 1.0
    tensors["advantages"][3] = 0.5
    long_batch = Batch([*batch.prompts[:3], long_prompt, *batch.prompts[4:]], tensors)
    roles = build(tiny_path, max_tokens_per_micro_batch=96)
    micro = roles.actor.micro_batches(long_batch)
    assert [3] in [m.rows for m in micro] and max(m.real_tokens for m in micro) == 480
    want = actor_pass(build(tiny_path, **PADDED), long_batch)
    assert_same(actor_pass(roles, long_batch), want)
