"""FSDP2 trainer roles (world size 1, gloo): log-prob parity with the engine, updates, weight sync, offload.

The roles come from the one builder (`build_components`) inside a real `HybridWorker`, whose phase methods the
tests call: what a run executes, not a copy of it."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms import AlgorithmConfig
from hybridrl.batch import Batch
from hybridrl.config import RunConfig
from hybridrl.controller import completions_to_batch
from hybridrl.data.config import DataConfig
from hybridrl.data.prompts import Prompt
from hybridrl.engines.base import SamplingParams
from hybridrl.engines.config import EngineConfig
from hybridrl.engines.native.hf import HFEngine
from hybridrl.errors import HybridRLError
from hybridrl.models.config import ModelConfig
from hybridrl.models.loading import load_causal_lm
from hybridrl.reshard import ReshardConfig, Resharder
from hybridrl.training.config import TrainerConfig
from hybridrl.workers.worker import HybridWorker
from tests.conftest import chat_prompt


def make_trainer(tiny_path, tokenizer, temperature=1.0, **overrides) -> HybridWorker:
    """A worker with the tiny model (its actor, reference and engine); trainer options from `overrides`."""
    cfg = RunConfig(
        model=ModelConfig(name="hf", path=tiny_path),
        trainer=TrainerConfig(lr=1e-2, micro_batch_size=4, **overrides),
        algorithm=AlgorithmConfig(group_size=4),
        engine=EngineConfig(temperature=temperature),
        data=DataConfig(train_batch_size=2),
    )
    return HybridWorker(cfg)


def full_params(worker: HybridWorker) -> dict[str, torch.Tensor]:
    """The actor's parameters, gathered from their FSDP shards."""
    return {n: t.clone() for n, t in worker.roles.actor.iter_full_params()}


@pytest.fixture()
def setup(tiny_path, tokenizer, process_group):
    engine = HFEngine(
        load_causal_lm(tiny_path, ModelConfig(), torch.float32), [tokenizer.eos_token_id], tokenizer.pad_token_id
    )
    prompts = [Prompt(chat_prompt(tokenizer, t), t, {"answer": "1"}) for t in ("copy: 12", "sort: 987")]
    return engine, prompts


def rollout(engine, prompts, temperature=1.0):
    comps = engine.generate(
        [p.token_ids for p in prompts], SamplingParams(n=4, temperature=temperature, max_new_tokens=6, seed=0)
    )
    return completions_to_batch(prompts, comps)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_trainer_logprobs_equal_engine_logprobs(setup, tiny_path, tokenizer, temperature):
    engine, prompts = setup
    trainer = make_trainer(tiny_path, tokenizer, temperature)
    batch = rollout(engine, prompts, temperature)
    out = trainer.logprob(batch)
    mask = batch["response_mask"].bool()
    diff = (out["old_logprobs"] - batch["engine_logprobs"]).abs()[mask]
    assert diff.max().item() < 1e-4, diff.max()
    # The frozen reference starts equal to the policy.
    assert torch.allclose(out["ref_logprobs"], out["old_logprobs"], atol=1e-6)


def test_update_changes_policy_and_reshard_makes_engine_follow(setup, tiny_path, tokenizer):
    engine, prompts = setup
    trainer = make_trainer(tiny_path, tokenizer)
    batch = rollout(engine, prompts)
    for k, v in trainer.logprob(batch).items():
        batch[k] = v
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)
    before = full_params(trainer)
    metrics = trainer.roles.actor.update(batch)
    for key in ("actor/pg_loss", "actor/kl", "actor/clip_frac", "actor/grad_norm", "actor/lr"):
        assert key in metrics
    after = dict(trainer.roles.actor.iter_full_params())
    assert any(not torch.equal(before[n], after[n]) for n in before)

    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    old_out = engine.generate([p.token_ids for p in prompts], greedy)
    engine.sleep(2)
    engine.wake_up(["weights"])
    Resharder(ReshardConfig(verify=True), engine, trainer.roles.actor.model.config).sync(trainer.roles.actor.model)
    engine.wake_up(["kv_cache"])
    new_batch = completions_to_batch(prompts, engine.generate([p.token_ids for p in prompts], greedy))
    # After the sync the engine's log-probs are the updated trainer's.
    lp = trainer.logprob(new_batch)["old_logprobs"]
    mask = new_batch["response_mask"].bool()
    assert (lp - new_batch["engine_logprobs"]).abs()[mask].max().item() < 1e-4
    assert not torch.allclose(
        torch.tensor([x for o in old_out for x in o.logprobs[:1]]), new_batch["engine_logprobs"][:, 0], atol=1e-4
    )


def test_verify_catches_a_stale_engine_tensor(setup, tiny_path, tokenizer):
    engine, _ = setup
    trainer = make_trainer(tiny_path, tokenizer)

    class Forgetful(HFEngine):
        def load_weights(self, named):
            super().load_weights([(n, t) for n, t in named if "layers.1.mlp.up_proj" not in n])

    forgetful = Forgetful.__new__(Forgetful)
    forgetful.__dict__.update(engine.__dict__)
    with torch.no_grad():
        for _, p in trainer.roles.actor.model.named_parameters():
            p.add_(0.01)
    with pytest.raises(HybridRLError, match="layers.1.mlp.up_proj"):
        Resharder(ReshardConfig(verify=True), forgetful, trainer.roles.actor.model.config).sync(
            trainer.roles.actor.model
        )


def test_gradient_accumulation_matches_one_big_batch(setup, tiny_path, tokenizer):
    engine, prompts = setup
    batch = rollout(engine, prompts)
    grads = []
    for micro in (8, 3):
        torch.manual_seed(0)
        trainer = make_trainer(tiny_path, tokenizer, grad_clip=0.0)
        trainer.roles.actor.cfg.micro_batch_size = micro
        b = Batch(batch.prompts, dict(batch.tensors), dict(batch.meta))
        for k, v in trainer.logprob(b).items():
            b[k] = v
        b["advantages"] = torch.linspace(-1, 1, len(b))
        # Capture the accumulated gradient right before the optimizer step.
        captured = {}
        real_step = trainer.roles.actor.optimizer.step

        def spy(*a, **kw):
            captured.update({n: p.grad.full_tensor().clone() for n, p in trainer.roles.actor.model.named_parameters()})
            return real_step(*a, **kw)

        trainer.roles.actor.optimizer.step = spy
        trainer.roles.actor.update(b)
        grads.append(captured)
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name


def test_offload_and_onload_keep_the_trainer_intact(setup, tiny_path, tokenizer):
    """The storage-resize offload on FSDP2 shards and Adam state (run on CPU here with enabled=True)."""
    from hybridrl.training.fsdp import reshard_units
    from hybridrl.training.offload import HostOffloader

    engine, prompts = setup
    trainer = make_trainer(tiny_path, tokenizer)
    batch = rollout(engine, prompts)
    for k, v in trainer.logprob(batch).items():
        batch[k] = v
    batch["advantages"] = torch.linspace(-1, 1, len(batch))
    trainer.roles.actor.update(batch)  # creates Adam state
    params = HostOffloader(lambda: trainer.roles.actor.model.parameters(), torch.device("cpu"), enabled=True)
    optim = HostOffloader(
        lambda: [v for s in trainer.roles.actor.optimizer.state.values() for v in s.values() if torch.is_tensor(v)],
        torch.device("cpu"),
        enabled=True,
    )
    before = trainer.logprob(batch)["old_logprobs"]
    state_before = {
        k: v.full_tensor().clone()
        for k, v in next(iter(trainer.roles.actor.optimizer.state.values())).items()
        if k != "step"
    }
    reshard_units(trainer.roles.actor.model)  # what the actor's offload does first: only sharded storage is offloaded
    moved = params.offload() + optim.offload()
    assert moved > 0
    assert all(p.to_local().untyped_storage().nbytes() == 0 for p in trainer.roles.actor.model.parameters())
    assert params.onload() + optim.onload() == moved
    assert torch.equal(trainer.logprob(batch)["old_logprobs"], before)
    state_after = next(iter(trainer.roles.actor.optimizer.state.values()))
    assert all(torch.equal(state_after[k].full_tensor(), v) for k, v in state_before.items())
    trainer.roles.actor.update(batch)  # still trains after the round trip
    # Pinned buffers are found again by the next offload (a fresh allocation per switch cost seconds on GPU).
    buffers = dict(optim._host)
    reshard_units(trainer.roles.actor.model)
    optim.offload()
    assert all(optim._host[k] is b for k, b in buffers.items())
    optim.onload()


def test_offload_in_flight_is_completed_or_cancelled():
    """offload(wait=False) keeps the device storage until `finish`/`complete`; an onload before that cancels it."""
    from hybridrl.training.offload import HostOffloader

    tensors = [torch.arange(6, dtype=torch.float32), torch.ones(3, 2)]
    off = HostOffloader(lambda: tensors, torch.device("cpu"), enabled=True)
    assert off.offload(wait=False) == 6 * 4 + 6 * 4
    assert all(t.untyped_storage().nbytes() > 0 for t in tensors)  # still whole while the copy runs
    assert off.onload() == 0  # cancelled: nothing was freed, nothing comes back
    tensors[0].add_(1)  # a change after the cancel must survive the next round trip
    assert off.offload(wait=False) == 48
    assert off.complete() == 48
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    assert off.complete() == 0  # nothing left to do
    assert off.onload() == 48
    assert torch.equal(tensors[0], torch.arange(1, 7, dtype=torch.float32))
    assert torch.equal(tensors[1], torch.ones(3, 2))


def test_the_reference_leaves_before_the_update_only_where_the_plan_says_the_update_needs_its_room(
    setup, tiny_path, tokenizer
):
    engine, prompts = setup
    batch = rollout(engine, prompts)
    worker = make_trainer(tiny_path, tokenizer)
    ref = worker.roles.ref
    ref.offloader.enabled = True
    update = worker.roles.memory_plan.phase_bytes("update")  # what the update adds (nothing is held on a CPU)
    ref_bytes = sum(p.to_local().untyped_storage().nbytes() for p in ref.model.parameters())
    enough = update + ref_bytes + worker.room.headroom  # the room it asks for counts the reference's bytes as free
    for free, leaves in ((enough, False), (enough - 1, True)):
        worker.room.free_bytes = lambda free=free: free
        b = batch.select(range(len(batch)))
        for k, v in worker.logprob(b).items():
            b[k] = v
        assert ref.offloader.in_flight  # its copy started behind the pass
        b["advantages"] = torch.linspace(-1, 1, len(b))
        metrics = worker.update(b)
        on_device = [p.to_local().untyped_storage().nbytes() > 0 for p in ref.model.parameters()]
        assert on_device == [not leaves] * len(on_device)
        assert ("offload/ref/offload_gb" in metrics) == leaves  # the step's memory moves report it


def test_reward_models_send_the_held_reference_away_and_the_step_reports_it(setup, tiny_path, tokenizer):
    engine, prompts = setup
    batch = rollout(engine, prompts)
    worker = make_trainer(tiny_path, tokenizer)
    ref = worker.roles.ref
    ref.offloader.enabled = True
    worker.room.free_bytes = lambda: 1 << 50  # room for everything: only the reward models' turn sends it away

    class Scorer:  # stands in for reward models, which need the device to themselves
        models = ["rm"]

        def __call__(self, b):
            return [0.0] * len(b), {"time/reward_model_s": 0.5}

    worker.roles.scorer = Scorer()
    for k, v in worker.logprob(batch).items():
        batch[k] = v
    worker.reward(batch)
    assert all(p.to_local().untyped_storage().nbytes() == 0 for p in ref.model.parameters())
    batch["advantages"] = torch.linspace(-1, 1, len(batch))
    metrics = worker.update(batch)
    assert metrics["offload/ref/offload_gb"] > 0 and metrics["time/reward_model_s"] == 0.5


@pytest.mark.parametrize("mode", ["eager", "lazy_tight", "lazy_roomy"])
def test_trainer_offload_choreography_changes_nothing(setup, tiny_path, tokenizer, mode):
    """Two iterations of the worker's own phases (wake → logprob → update), with every offloader on (the reference
    leaves early, in flight behind the update), equal a worker that never offloads. Eager offload frees at wake-up;
    lazy offload frees only when the engine finds no room (tight: a device with nothing free frees everything at the
    engine's first allocation; roomy: nothing is freed, and the onload is a cancel)."""
    engine, prompts = setup
    batch = rollout(engine, prompts)
    runs = []
    for offload in (True, False):
        torch.manual_seed(0)
        worker = make_trainer(tiny_path, tokenizer, grad_clip=0.0, offload_lazy=mode != "eager")
        assert worker.roles.rollout.engine.gates_memory  # the fused engine: the lazy path is the one taken
        worker.room.free_bytes = (lambda: 0) if mode == "lazy_tight" else (lambda: 1 << 50)
        actor, ref = worker.roles.actor, worker.roles.ref
        for off in (actor.param_offload, ref.offloader, actor.optim_offload):
            off.enabled = offload
        logs = []
        for _ in range(2):
            worker.wake()
            worker.roles.rollout.engine.sleep(2)  # weights out: the next wake allocates them through the gate
            worker.roles.rollout.engine.wake_up(["weights"])
            worker.sleep()
            b = batch.select(range(len(batch)))
            for k, v in worker.logprob(b).items():
                b[k] = v
            logs.append(b["ref_logprobs"])
            logs.append(b["old_logprobs"])
            if offload:
                assert ref.offloader._freeing  # on its way out behind the update
            b["advantages"] = torch.linspace(-1, 1, len(b))
            worker.update(b)
        worker.wake()
        worker.roles.rollout.engine.sleep(2)
        worker.roles.rollout.engine.wake_up(["weights"])
        if offload:
            freed = mode != "lazy_roomy"
            for model in (ref.model, actor.model):
                assert all((p.to_local().untyped_storage().nbytes() == 0) == freed for p in model.parameters())
        worker.sleep()
        actor.onload_params()
        actor.onload_optimizer()
        params = {n: p.full_tensor().clone() for n, p in actor.model.named_parameters()}
        runs.append((logs, params))
    (logs_a, params_a), (logs_b, params_b) = runs
    assert all(torch.equal(a, b) for a, b in zip(logs_a, logs_b))
    assert all(torch.equal(params_a[n], params_b[n]) for n in params_a)


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(setup, tiny_path, tokenizer):
    engine, prompts = setup
    worker = make_trainer(tiny_path, tokenizer, max_nonfinite_steps=2)
    actor = worker.roles.actor
    batch = rollout(engine, prompts)
    for k, v in worker.logprob(batch).items():
        batch[k] = v
    batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
    before = full_params(worker)
    batch["advantages"][0, 0] = float("nan")  # one real token: the loss and every gradient become NaN
    metrics = actor.update(batch)
    assert metrics["actor/nonfinite_steps"] == 1 and math.isnan(metrics["actor/grad_norm"])
    after = full_params(worker)
    assert all(torch.equal(before[n], after[n]) for n in before)  # the step was skipped
    with pytest.raises(HybridRLError, match=r"2 optimizer steps in a row .*\(trainer.max_nonfinite_steps=2\)"):
        actor.update(batch)


def test_no_checkpoint_from_nonfinite_weights(tmp_path, tiny_path, tokenizer, process_group):
    worker = make_trainer(tiny_path, tokenizer)
    actor = worker.roles.actor
    actor.save(str(tmp_path / "ok"))  # finite: written
    with torch.no_grad():
        next(actor.model.parameters()).to_local()[0].fill_(float("inf"))
    with pytest.raises(HybridRLError, match="refusing to write a checkpoint"):
        actor.save(str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()


def test_an_engine_that_stays_awake_rolls_out_what_a_sleeping_one_does(tiny_path, tokenizer, process_group):
    """engine.sleep_level=0: three iterations (wake → generate → sleep → logprob → update → reshard) sample the same
    tokens and leave the same weights as sleep level 2 (which drops the engine's weights and KV cache and refills them),
    while the engine's cache and weights stay the same tensors throughout (so its CUDA graphs would too)."""
    prompts = [Prompt(chat_prompt(tokenizer, t), t, {"answer": "1"}) for t in ("copy: 12", "sort: 987")]
    runs = []
    for level in (2, 0):
        torch.manual_seed(0)
        cfg = RunConfig(
            model=ModelConfig(name="hf", path=tiny_path),
            trainer=TrainerConfig(lr=1e-2, micro_batch_size=4),
            algorithm=AlgorithmConfig(group_size=4),
            engine=EngineConfig(sleep_level=level),
            data=DataConfig(train_batch_size=2),
        )
        worker = HybridWorker(cfg)
        engine = worker.roles.rollout.engine
        slept = []
        real_sleep = engine.sleep
        engine.sleep = lambda lvl=1: (slept.append(lvl), real_sleep(lvl))[1]
        seen, caches, weights = [], [], []
        for step in range(1, 4):
            worker.wake()
            comps = worker.generate([p.token_ids for p in prompts], step, SamplingParams(n=4, max_new_tokens=6))
            caches.append(engine.cache)
            weights.append(next(iter(engine.named_weights()))[1].data_ptr())
            worker.sleep()
            b = completions_to_batch(prompts, comps)
            for k, v in worker.logprob(b).items():
                b[k] = v
            seen += [b["responses"], b["old_logprobs"]]
            b["advantages"] = torch.linspace(-1, 1, len(b))
            worker.update(b)
            worker.reshard()
        assert slept == ([2, 2, 2] if level else [])
        if level == 0:
            assert caches[0] is not None and all(c is caches[0] for c in caches) and len(set(weights)) == 1
        else:
            assert len({id(c) for c in caches}) == 3  # a new cache after every wake-up
        runs.append((seen, full_params(worker)))
    (seen_a, params_a), (seen_b, params_b) = runs
    for i, (a, b) in enumerate(zip(seen_a, seen_b)):
        assert torch.equal(a, b), i
    assert all(torch.equal(params_a[n], params_b[n]) for n in params_a)
