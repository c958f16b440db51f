"""LoRA (`model.lora`): config errors, adapters-only training, the base as the reference, merged weights in the
engine, engine/trainer log-prob parity.

Expected weights come from PEFT itself (`merge_and_unload` on a fresh PEFT model given the trainer's parameters) or
from W + (alpha/rank)·B·A written out in the test, never from the resharder under test.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hybridrl.algorithms import AlgorithmConfig
from hybridrl.config import RunConfig, validate
from hybridrl.controller import completions_to_batch
from hybridrl.data.config import DataConfig
from hybridrl.data.prompts import Prompt
from hybridrl.engines.base import SamplingParams
from hybridrl.engines.config import EngineConfig, NativeOptions
from hybridrl.errors import ConfigError
from hybridrl.models.config import LoraOptions, ModelConfig
from hybridrl.reshard import ReshardConfig, Resharder, build_layout, reference_shard
from hybridrl.reshard.lora_merge import LoraMerge, merged_weight
from hybridrl.reshard.testing import TensorDictEngine
from hybridrl.training.config import TrainerConfig
from hybridrl.workers.worker import HybridWorker
from tests.tiny_models import KINDS, reference_logprobs, tiny_config, tiny_model
from tests.unit.test_config import composed

RANK, ALPHA = 4, 8.0
PROMPTS = [Prompt([5, 17, 3, 9, 11], "", {}), Prompt([21, 2, 40], "", {})]


def lora_worker(path, engine: EngineConfig | None = None, targets=None, **trainer) -> HybridWorker:
    """A worker on the tiny model with rank-4 adapters (every projection unless `targets`)."""
    lora = LoraOptions(rank=RANK, alpha=ALPHA, **({"target_modules": targets} if targets else {}))
    cfg = RunConfig(
        model=ModelConfig(name="hf", path=path, lora=lora),
        trainer=TrainerConfig(**{"lr": 5e-2, "micro_batch_size": 4, **trainer}),
        algorithm=AlgorithmConfig(group_size=4),
        engine=engine or EngineConfig(),
        data=DataConfig(train_batch_size=2),
    )
    return HybridWorker(cfg)


def rollout(worker: HybridWorker, step: int = 1):
    comps = worker.generate([p.token_ids for p in PROMPTS], step, SamplingParams(n=4, max_new_tokens=6))
    return completions_to_batch(PROMPTS, comps)


def train_once(worker: HybridWorker):
    """One iteration's logprob → update → reshard on a fresh rollout; returns the batch."""
    batch = rollout(worker)
    for k, v in worker.logprob(batch).items():
        batch[k] = v
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)
    worker.update(batch)
    worker.reshard()
    return batch


def peft_merged(base: torch.nn.Module, trained: dict[str, torch.Tensor], targets=None) -> dict[str, torch.Tensor]:
    """PEFT's own merge of `trained` (the trainer's full parameters, by name) into a fresh copy of `base`."""
    cfg = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=targets or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    peft = get_peft_model(base, cfg)
    inner = peft.get_base_model()
    missing, unexpected = inner.load_state_dict(trained, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    return {k: v.detach().clone() for k, v in peft.merge_and_unload().state_dict().items()}


def trainer_params(worker: HybridWorker) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in worker.roles.actor.iter_full_params()}


# -- config ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.lora.rank=0", "model.lora.rank"),
        ("model.lora.rank=-8", "model.lora.rank"),
        ("model.lora.alpha=0", "model.lora.alpha"),
        ("model.lora.dropout=1.0", "model.lora.dropout"),
        ("model.lora.target_modules=[]", "model.lora.target_modules"),
        ("model.lora.target_modules=[self_attn.q_proj]", "model.lora.target_modules"),
    ],
)
def test_bad_lora_values_fail_at_composition_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(composed("model.lora.rank=8", override))


def test_lora_is_off_by_default_and_on_with_a_rank():
    assert not validate(composed()).model.lora.enabled
    lora = validate(composed("model.lora.rank=16", "model.lora.alpha=32")).model.lora
    assert lora.enabled and lora.scale == 2.0 and "down_proj" in lora.target_modules


def test_unknown_target_module_fails_at_setup_before_any_weight_loads(tiny_path, tmp_path, process_group):
    # A model folder with its config and tokenizer but no weights: only a check that reads no weight can pass it.
    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_path, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: \['qkv_proj'\].*qwen2.*o_proj"):
        lora_worker(str(folder), targets=["q_proj", "qkv_proj"])


# -- training ---------------------------------------------------------------------------------------------------


def test_only_the_adapters_train_and_no_reference_copy_is_built(tiny_path, process_group):
    worker = lora_worker(tiny_path)
    actor = worker.roles.actor
    assert worker.roles.ref is None and actor.serves_reference
    names = {id(p): n for n, p in actor.model.named_parameters()}
    optimized = [names[id(p)] for g in actor.optimizer.param_groups for p in g["params"]]
    assert optimized and all(".lora_A." in n or ".lora_B." in n for n in optimized)
    assert len(optimized) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    before = trainer_params(worker)
    assert all(before[n].abs().max() == 0 for n in before if ".lora_B." in n)  # PEFT starts B at 0
    train_once(worker)
    train_once(worker)  # the first step moves only B (A's gradient is B-weighted, and B starts at 0)
    after = trainer_params(worker)
    assert all(id(p) in names for p in actor.optimizer.state)
    assert {names[id(p)] for p in actor.optimizer.state} == set(optimized)
    for n in before:
        if ".lora_" in n:
            assert not torch.equal(before[n], after[n]), n
        else:
            assert torch.equal(before[n], after[n]), n  # the base is frozen
    report = worker.memory_report()
    assert "roles/ref" not in report
    stats = report["roles/actor"]
    assert stats["ref_copy_gb"] == 0 and 0 < stats["lora_adapter_gb"] < stats["lora_base_gb"]


def test_reference_log_probs_are_the_base_models(tiny_path, process_group):
    worker = lora_worker(tiny_path)
    train_once(worker)
    batch = rollout(worker, step=2)
    out = worker.logprob(batch)
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    mask = batch["response_mask"].bool()
    for i, c in enumerate(batch["responses"]):
        n = int(mask[i].sum())
        want = reference_logprobs(base, batch.prompts[i], c[:n].tolist())
        assert torch.allclose(out["ref_logprobs"][i, :n], want, atol=1e-5), i
    assert (out["ref_logprobs"] - out["old_logprobs"]).abs()[mask].max() > 1e-2  # the adapters moved the policy


@pytest.mark.parametrize("impl", ["fused", "hf"])
def test_engine_holds_the_merged_weights_and_agrees_on_log_probs(tiny_path, process_group, impl):
    worker = lora_worker(tiny_path, EngineConfig(native=NativeOptions(impl=impl)))
    train_once(worker)
    expected = peft_merged(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32), trainer_params(worker))
    engine = worker.roles.rollout.engine
    config = worker.roles.actor.model.config
    held = dict(engine.named_weights())
    for name, t in held.items():
        want = reference_shard(config, name, expected, style=engine.weight_layout_style)
        assert (t - want).abs().max() < 1e-6, name
    assert any(
        (expected[n] - p).abs().max() > 1e-3
        for n, p in AutoModelForCausalLM.from_pretrained(tiny_path).state_dict().items()
        if n in expected
    )
    # Sampled by the engine from the merged weights, scored by the trainer through its adapters.
    batch = rollout(worker, step=2)
    old = worker.logprob(batch)["old_logprobs"]
    mask = batch["response_mask"].bool()
    assert (old - batch["engine_logprobs"]).abs()[mask].max() < 1e-4


@pytest.mark.parametrize("lazy", [False, True])
def test_offload_round_trips_change_nothing(tiny_path, process_group, lazy):
    """Two iterations with the actor's parameter and optimizer offloaders on (the frozen base, outside FSDP on one
    rank, moves with the adapters) equal a worker that never offloads (run on CPU with the offloaders forced on).
    Lazy: a device with no free memory, so the engine's first allocation frees everything."""
    runs = []
    for offload in (True, False):
        worker = lora_worker(tiny_path, grad_clip=0.0, offload_lazy=lazy)
        worker.room.free_bytes = lambda: 0
        actor = worker.roles.actor
        actor.param_offload.enabled = actor.optim_offload.enabled = offload
        with torch.no_grad():  # on CPU the loaded base is memory-mapped from the file; on a GPU it is owned memory
            for p in actor.model.parameters():
                if not p.requires_grad:
                    p.data = p.data.clone()
        logs = []
        for step in (1, 2):
            worker.wake()
            if lazy:
                worker.roles.rollout.engine.memory_gate(1)  # what the engine's next allocation does
            if offload:
                assert all(p.untyped_storage().nbytes() == 0 for p in actor.model.parameters() if not p.requires_grad)
            batch = rollout(worker, step)
            worker.sleep()
            for k, v in worker.logprob(batch).items():
                batch[k] = v
            logs += [batch["old_logprobs"], batch["ref_logprobs"]]
            batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)
            worker.update(batch)
            worker.reshard()
        runs.append((logs, trainer_params(worker)))
    (logs_a, params_a), (logs_b, params_b) = runs
    assert all(torch.equal(a, b) for a, b in zip(logs_a, logs_b))
    assert all(torch.equal(params_a[n], params_b[n]) for n in params_a)


# -- the merge inside the resharder -----------------------------------------------------------------------------


def test_merged_weight_by_hand():
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    a = torch.tensor([[1.0, 0.0]])  # r=1 × in=2
    b = torch.tensor([[2.0], [1.0]])  # out=2 × r=1
    assert torch.equal(merged_weight(w, a, b, 0.5), torch.tensor([[2.0, 2.0], [3.5, 4.0]]))
    assert torch.equal(w, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # never written in place
    # A bfloat16 base with float32 factors: merged in bfloat16 (factors cast), the sum rounded once.
    wb = torch.tensor([[1.0, 3.0]], dtype=torch.bfloat16)
    a32, b32 = torch.tensor([[0.125, 0.5]]), torch.tensor([[0.25]])  # exact in bfloat16
    got = merged_weight(wb, a32, b32, 0.25)
    assert got.dtype == torch.bfloat16
    # 1 + 0.25·0.25·0.125 = 1 + 2^-7 and 3 + 0.25·0.25·0.5 = 3 + 2^-5: both representable, so exact
    assert torch.equal(got, torch.tensor([[1.0078125, 3.03125]], dtype=torch.bfloat16))
    # and sums that are not representable come out as the correctly rounded (exact float32) sum
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 16, generator=g).bfloat16()
    a, b = (torch.randint(-3, 4, shape, generator=g).bfloat16() for shape in ((2, 16), (16, 2)))
    assert torch.equal(merged_weight(w, a, b, 0.25), (w.float() + 0.25 * (b.float() @ a.float())).bfloat16())


def _peft_tiny(kind: str, seed: int = 0):
    """A PEFT-wrapped tiny model of `kind` whose B factors are random (as after training)."""
    model = tiny_model(kind)
    peft = get_peft_model(
        model,
        LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if ".lora_B." in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return peft


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("style, tp_rank", [("fused", 1), ("hf", 0)])
def test_resharder_delivers_peft_merged_weights_for_every_layout(kind, style, tp_rank):
    import copy

    peft = _peft_tiny(kind)
    expected = copy.deepcopy(peft).merge_and_unload().state_dict()
    config = tiny_config(kind)
    engine = TensorDictEngine.from_layout(build_layout(config, style, tp_rank, 2))
    stats = Resharder(ReshardConfig(verify=True), engine, config, tp_rank=tp_rank, tp_size=2, style=style).sync(peft)
    for name, held in engine.tensors.items():
        want = reference_shard(config, name, expected, style=style, tp_rank=tp_rank, tp_size=2)
        assert (held - want).abs().max() < 1e-6, name
    assert stats.lora_merged == 2 * 5 and stats.merge_s > 0
    # The trainer's own tensors are untouched by the merge.
    assert torch.equal(
        peft.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight,
        tiny_model(kind).model.layers[0].self_attn.q_proj.weight,
    )


def test_adapters_switched_off_stream_the_base_weights():
    peft = _peft_tiny("qwen3")
    base = {n: p.detach().clone() for n, p in tiny_model("qwen3").named_parameters()}
    config = tiny_config("qwen3")
    engine = TensorDictEngine.from_layout(build_layout(config, "hf"), fill=0.0)
    with peft.disable_adapter():  # the effective model is the base: that is what must arrive
        Resharder(ReshardConfig(), engine, config, style="hf").sync(peft)
    assert all(torch.equal(engine.tensors[n], base[n]) for n in engine.tensors)
    assert LoraMerge.from_model(tiny_model("qwen3")) is None


@pytest.mark.slow
def test_cpu_lora_recipe_learns(tmp_path):
    """`python -m hybridrl recipe=cpu_lora` learns: the last 20% of steps beat the first 20% by 0.2 or more."""
    import json

    from hybridrl.tracking.plot import first_last_means
    from tests.integration.test_e2e import run_app

    run_dir = tmp_path / "run"
    r = run_app(["recipe=cpu_lora", "logger.progress_bar=false", f"hydra.run.dir={run_dir}"], tmp_path, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = first_last_means([row["reward/mean"] for row in rows])
    assert last >= first + 0.2, (first, last)
    # The engine runs the merged W + s·B·A, the trainer W·x + s·B·(A·x): float32 rounding differs, and over
    # 150 steps its worst token reaches ~7e-5 (the mean stays ~1e-6). A merge that is wrong (scale, transpose,
    # a layer missed) moves log-probs by 1e-2 or more.
    assert max(row["mismatch/logp_abs_mean"] for row in rows) < 1e-5
    assert max(row["mismatch/logp_abs_max"] for row in rows) < 1e-3
