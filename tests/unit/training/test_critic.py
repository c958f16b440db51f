"""The critic role (world size 1, gloo): which positions become values, its update, and its memory choreography.

Expected values come from outside the code under test: a value head rigged to output the id of the token at each
position (so the value of response token t must be the id of the token before it, by hand), and a plain unsharded
Hugging Face model run on each unpadded sequence alone."""

from __future__ import annotations

import pytest
import torch

from hybridrl.algorithms import AlgorithmConfig
from hybridrl.batch import Batch
from hybridrl.config import RunConfig
from hybridrl.controller import completions_to_batch
from hybridrl.data.config import DataConfig
from hybridrl.data.prompts import Prompt
from hybridrl.engines.base import SamplingParams
from hybridrl.engines.native.hf import HFEngine
from hybridrl.estimation import estimate
from hybridrl.models.config import ModelConfig
from hybridrl.models.loading import load_causal_lm
from hybridrl.training.config import TrainerConfig
from hybridrl.training.critic import load_value_model
from hybridrl.training.critic_config import CriticConfig
from hybridrl.workers.build import build_critic
from hybridrl.workers.worker import HybridWorker
from tests.conftest import chat_prompt

PPO = dict(name="ppo", lam=0.95, kl_in="reward", kl_estimator="k1")


def ppo_config(tiny_path, group_size=2, critic=None, **trainer) -> RunConfig:
    return RunConfig(
        model=ModelConfig(name="hf", path=tiny_path),
        algorithm=AlgorithmConfig(group_size=group_size, **PPO),
        trainer=TrainerConfig(**{"lr": 1e-2, "micro_batch_size": 4, **trainer}),
        critic=critic or CriticConfig(),
        data=DataConfig(train_batch_size=2),
    )


def make_critic(tiny_path, tokenizer, **critic_kw):
    cfg = ppo_config(tiny_path, critic=CriticConfig(**critic_kw))
    mesh = cfg.topology().fsdp_mesh("cpu")
    return build_critic(cfg, tiny_path, torch.device("cpu"), mesh, tokenizer.pad_token_id)


def ragged_batch() -> Batch:
    """Prompts of 3 and 5 tokens; responses of 2 and 4 tokens (the first right-padded with garbage ids)."""
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25]]
    responses = torch.tensor([[31, 32, 99, 99], [41, 42, 43, 44]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    return Batch(prompts, {"responses": responses, "response_mask": mask})


def rig_head_to_token_ids(critic) -> None:
    """Make the critic's output at every position `id of the token there + 0.5`: the body's last hidden state is
    replaced by (token id, 0, 0, ...), the head reads channel 0 with weight 1 and bias 0.5."""
    inner = critic.model.model
    seen = {}
    inner.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.update(ids=args[0] if args else kwargs["input_ids"]), with_kwargs=True
    )

    def replace(_m, _args, out):
        h = torch.zeros_like(out.last_hidden_state)
        h[..., 0] = seen["ids"].to(h.dtype)
        out.last_hidden_state = h
        return out

    inner.register_forward_hook(replace)
    with torch.no_grad():
        w, b = critic.model.score.weight.to_local(), critic.model.score.bias.to_local()
        w.zero_()
        w[0, 0] = 1.0
        b.fill_(0.5)


@pytest.mark.parametrize("micro", [1, 2])
def test_value_of_each_response_token_is_read_before_it(tiny_path, tokenizer, process_group, micro):
    critic = make_critic(tiny_path, tokenizer, micro_batch_size=micro)
    rig_head_to_token_ids(critic)
    values, _ = critic.compute_values(critic.micro_batches(ragged_batch()))
    # By hand: V(s_t) is read at the token before response token t (the prompt's last token for t = 0); 0 at padding.
    want = torch.tensor([[13.5, 31.5, 0.0, 0.0], [25.5, 41.5, 42.5, 43.5]])
    assert torch.equal(values["values"], want)


def test_values_equal_an_unpadded_hf_forward_per_sequence(tiny_path, tokenizer, process_group):
    critic = make_critic(tiny_path, tokenizer, micro_batch_size=2)
    values = critic.compute_values(critic.micro_batches(ragged_batch()))[0]["values"]
    plain = load_value_model(tiny_path, ModelConfig(), torch.float32, torch.device("cpu"), head_seed=0).eval()
    batch = ragged_batch()
    for i, prompt in enumerate(batch.prompts):
        n = int(batch["response_mask"][i].sum())
        seq = torch.tensor([prompt + batch["responses"][i, :n].tolist()])
        with torch.no_grad():
            want = plain(seq).logits[0, len(prompt) - 1 : len(prompt) - 1 + n, 0]
        torch.testing.assert_close(values[i, :n], want, rtol=1e-5, atol=1e-6)
        assert torch.all(values[i, n:] == 0)
    assert values.abs().max() > 0  # a fresh head, not zeros: the comparison above means something


def test_value_loss_and_accumulation_over_micro_batches(tiny_path, tokenizer, process_group):
    """One mini-batch in micro-batches of 1 logs the whole batch's loss and steps like one big micro-batch."""
    runs = []
    for micro in (1, 2):
        critic = make_critic(tiny_path, tokenizer, micro_batch_size=micro, grad_clip=0.0)
        batch = ragged_batch()
        old = critic.compute_values(critic.micro_batches(batch))[0]["values"]
        batch["values"] = old
        batch["returns"] = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.5]])
        grads, real_step = {}, critic.optimizer.step

        def spy(*a, **kw):  # the accumulated gradient, right before the optimizer step
            grads.update({n: p.grad.full_tensor().clone() for n, p in critic.model.named_parameters()})
            return real_step(*a, **kw)

        critic.optimizer.step = spy
        metrics = critic.update(batch)
        runs.append((metrics, grads, old))
    (m1, p1, old), (m2, p2, _) = runs
    mask = ragged_batch()["response_mask"]
    returns = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.5]])
    # By hand: new values == old ones at the first (only) step, so the clip is inactive and the loss is
    # 0.5 * token-mean of (V - R)^2 over the 6 response tokens.
    want = 0.5 * (((old - returns) ** 2) * mask).sum().item() / 6
    assert m1["critic/value_loss"] == pytest.approx(want, rel=1e-5)
    assert m2["critic/value_loss"] == pytest.approx(want, rel=1e-5)
    assert m1["critic/vf_clipfrac"] == 0.0
    assert m1["critic/vpred_mean"] == pytest.approx((old * mask).sum().item() / 6, rel=1e-5)
    for name in p1:
        torch.testing.assert_close(p1[name], p2[name], rtol=1e-5, atol=1e-7)
    assert any(g.abs().max() > 0 for g in p1.values())


def test_critic_learns_the_returns(tiny_path, tokenizer, process_group):
    critic = make_critic(tiny_path, tokenizer, lr=1e-2)
    batch = ragged_batch()
    batch["returns"] = torch.tensor([[1.0, 1.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    losses = []
    for _ in range(15):
        batch["values"] = critic.compute_values(critic.micro_batches(batch))[0]["values"]
        losses.append(critic.update(batch)["critic/value_loss"])
    assert losses[-1] < 0.1 * losses[0]


@pytest.fixture()
def rollout_batch(tiny_path, tokenizer, process_group):
    engine = HFEngine(
        load_causal_lm(tiny_path, ModelConfig(), torch.float32), [tokenizer.eos_token_id], tokenizer.pad_token_id
    )
    prompts = [Prompt(chat_prompt(tokenizer, t), t, {"answer": "12"}) for t in ("copy: 12", "sort: 987")]
    comps = engine.generate([p.token_ids for p in prompts], SamplingParams(n=2, max_new_tokens=6, seed=0))
    return completions_to_batch(prompts, comps)


@pytest.mark.parametrize("mode", ["eager", "lazy_tight", "lazy_roomy"])
def test_critic_offload_choreography_changes_nothing(tiny_path, tokenizer, rollout_batch, mode):
    """Two iterations of the worker's own phases (wake → logprob → values → reward → advantages → update_critic →
    update), with every offloader on (the critic leaves in flight behind the actor's update), equal a worker that
    never offloads. Lazy offload: the engine asks for room after wake-up; a device with none frees everything, a
    roomy one frees nothing (and the onloads are cancels)."""
    from hybridrl.data.synthetic import synthetic_reward  # noqa: F401  (registers the reward)

    runs = []
    for offload in (True, False):
        torch.manual_seed(0)
        worker = HybridWorker(ppo_config(tiny_path, grad_clip=0.0, offload_lazy=mode != "eager"))
        worker.room.free_bytes = (lambda: 0) if mode == "lazy_tight" else (lambda: 1 << 50)
        actor, critic = worker.roles.actor, worker.roles.critic
        for off in (
            actor.param_offload,
            actor.optim_offload,
            worker.roles.ref.offloader,
            critic.param_offload,
            critic.optim_offload,
        ):
            off.enabled = offload
        seen = []
        for _ in range(2):
            worker.wake()
            if mode != "eager":
                worker.roles.rollout.engine.memory_gate(1)  # what the engine's next allocation does
            if offload:
                freed = mode != "lazy_roomy"
                assert all((p.to_local().untyped_storage().nbytes() == 0) == freed for p in critic.model.parameters())
            worker.sleep()
            b = rollout_batch.select(range(len(rollout_batch)))
            for k, v in worker.logprob(b).items():
                b[k] = v
            b["values"] = worker.values(b)["values"]
            scored = worker.reward(b)
            scores, extras = scored.scores, scored.extras
            estimate(worker.cfg.algorithm, b, scores, extras, 6)
            seen += [b["values"], b["advantages"], b["returns"]]
            metrics = worker.update_critic(b)
            seen.append(torch.tensor([metrics["critic/value_loss"], metrics["critic/grad_norm"]]))
            if offload:
                assert critic.param_offload._freeing  # on its way out behind the actor's update
            worker.update(b)
        worker.wake()
        critic.onload_params()
        critic.onload_optimizer()
        params = {n: p.full_tensor().clone() for n, p in critic.model.named_parameters()}
        runs.append((seen, params))
    (seen_a, params_a), (seen_b, params_b) = runs
    for i, (a, b) in enumerate(zip(seen_a, seen_b)):
        assert torch.equal(a, b), i
    assert all(torch.equal(params_a[n], params_b[n]) for n in params_a)


def test_validation_scoring_with_reward_models_moves_out_what_a_lazy_offload_kept(tiny_path, tokenizer, rollout_batch):
    """Validation scores while the engine is awake (wake → generate → reward, no sleep): before a reward model comes
    onto the device, the trainer state a lazy offload left there goes out, as an eager offload had made it."""
    from dataclasses import replace

    from hybridrl.data.synthetic import synthetic_reward  # noqa: F401  (registers the reward)
    from hybridrl.rewards.reward_model import RewardModelConfig, RewardModelsConfig
    from hybridrl.training.offload import local_tensor

    cfg = replace(ppo_config(tiny_path), reward_model=RewardModelsConfig([RewardModelConfig(name="rm", path="tiny")]))
    worker = HybridWorker(cfg)
    worker.room.free_bytes = lambda: 1 << 50  # the engine finds room: nothing moves at wake-up
    actor = worker.roles.actor
    actor.param_offload.enabled = actor.optim_offload.enabled = True
    worker.wake()
    assert all(local_tensor(p).untyped_storage().nbytes() > 0 for p in actor.model.parameters())
    worker.reward(rollout_batch.select(range(len(rollout_batch))))
    assert all(local_tensor(p).untyped_storage().nbytes() == 0 for p in actor.model.parameters())
    worker.sleep()
    worker.logprob(rollout_batch.select(range(len(rollout_batch))))  # comes back for the next step
    assert all(local_tensor(p).untyped_storage().nbytes() > 0 for p in actor.model.parameters())
