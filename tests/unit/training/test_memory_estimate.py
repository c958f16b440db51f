"""The memory estimate: its arithmetic by hand, its activation count against what torch saves, the plan and the
fit check (a pretend device size on the CPU)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from hybridrl.config import RunConfig
from hybridrl.errors import HybridRLError
from hybridrl.models.config import ModelConfig
from hybridrl.plan import check_fit, estimate_report, main, make_plan, model_dims
from hybridrl.training.config import TrainerConfig
from hybridrl.training.memory_estimate import (
    EngineMemory,
    GiB,
    MemoryInputs,
    ModelDims,
    activation_bytes_per_token,
    estimate_phases,
    logits_bytes,
    logits_path,
)

#: Published shapes of Qwen2.5 (their config.json), to plan for without any weights.
QWEN25 = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}  # fmt: skip


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict[str, str]:
    """config.json folders of the three shapes (no weights)."""
    root = tmp_path_factory.mktemp("shapes")
    out = {}
    for name, kw in QWEN25.items():
        config = transformers.Qwen2Config(architectures=["Qwen2ForCausalLM"], max_position_embeddings=32768, **kw)
        config.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def qwen2_params(h: int, i: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool) -> int:
    """A Qwen2 decoder's parameters by hand: q/k/v with bias, o without, gate/up/down, two norms a layer, the
    embedding, the final norm, and an output head unless tied."""
    d = h // heads
    attn = (h * h + h) + 2 * (h * kv_heads * d + kv_heads * d) + h * h
    layer = attn + 3 * h * i + 2 * h
    return layers * layer + vocab * h + h + (0 if tied else vocab * h)


@pytest.mark.parametrize("name", list(QWEN25))
def test_model_size_comes_from_config_json_alone(shapes, name):
    kw = QWEN25[name]
    dims = model_dims(shapes[name])
    want = qwen2_params(
        kw["hidden_size"],
        kw["intermediate_size"],
        kw["num_hidden_layers"],
        kw["num_attention_heads"],
        kw["num_key_value_heads"],
        kw["vocab_size"],
        kw["tie_word_embeddings"],
    )
    assert dims.params == want
    assert (dims.kv_dim, dims.vocab) == (kw["num_key_value_heads"] * kw["hidden_size"] // kw["num_attention_heads"],
                                         kw["vocab_size"])  # fmt: skip


TOY = ModelDims(params=10_000, layers=2, hidden=8, q_dim=8, kv_dim=4, intermediate=16, vocab=50, tied=True)


def toy_inputs(**changes) -> MemoryInputs:
    """TOY on two ranks with 100 update and 200 log-prob tokens, half the logits kept, a small engine."""
    return MemoryInputs(
        dims=TOY,
        world=2,
        compute_bytes=2,
        update_tokens=100,
        logprob_tokens=200,
        kept_fraction=0.5,
        engine=EngineMemory(weights=20_000, kv_cache=5_000, workspace=1_000),
        **changes,
    )


def test_phases_by_hand_for_a_known_shape():
    inp = toy_inputs(ref=True)
    p = estimate_phases(inp)
    # State per rank: float32 masters 4P/2, Adam 8P/2; gathered bf16 copy of the whole model 2P.
    assert p["update"]["params"] == 4 * 10_000 / 2 + 2 * 10_000
    assert p["update"]["optimizer"] == 8 * 10_000 / 2
    assert p["update"]["grads"] == 4 * 10_000 / 2 + 2 * 10_000
    # Eager activations per token and layer: 2*(2*8 + 2*4 + 4*16 + 4*8) + 8*8 = 304 bytes; 2 layers, 100 tokens.
    assert p["update"]["activations"] == 304 * 2 * 100
    # Logits (torch path off: fused): 50 kept positions x vocab 50 x 2 bytes; their gradient is written over them.
    assert p["update"]["logits"] == 50 * 50 * 2
    # The reference: bf16 shard P/2 during the update; beside the actor in the log-prob pass, gathered as well.
    assert p["update"]["others"] == 2 * 10_000 / 2
    assert p["logprob"]["others"] == 2 * 10_000 / 2 + 2 * 10_000
    assert p["logprob"]["logits"] == 100 * 50 * 2
    # Units that reshard after each forward: half the model gathered at once, the actor's units freed before the
    # reference's are gathered, so the pass holds one such copy (in `params`), not two.
    units = estimate_phases(inp.with_(gathered_fraction=0.5, reshard_after_forward=True))["logprob"]
    assert (units["params"], units["others"]) == (4 * 10_000 / 2 + 2 * 10_000 * 0.5, 2 * 10_000 / 2)
    # The rollout: the engine, the actor's state and the reference, nothing offloaded.
    assert p["generate"] == {"params": 4 * 10_000 / 2 + 8 * 10_000 / 2, "engine": 26_000, "others": 10_000}
    off = estimate_phases(inp.with_(offload=frozenset({"params", "optimizer"}), ref_offload=True))
    assert off["generate"] == {"params": 0.0, "engine": 26_000, "others": 0.0}
    # Gradient checkpointing keeps each layer's input (2 bytes x hidden) and recomputes one layer at a time.
    # (At 400 tokens, so the backward rather than the gradient reduction after it is the update's peak.)
    ckpt = estimate_phases(inp.with_(checkpointing=True, update_tokens=400))["update"]["activations"]
    assert ckpt == (2 * 2 * 8 + 304) * 400


def test_logits_of_each_log_prob_path_by_hand():
    # 1000 kept positions, vocabulary 50, bf16 compute; chunks of 100 positions.
    assert logits_path(0, True) == "fused" and logits_path(0, False) == "torch"
    assert logits_path(100, True) == "chunked_fused" and logits_path(100, False) == "chunked"
    assert logits_bytes(1000, 50, 2, "fused", True) == 1000 * 50 * 2  # the gradient over the logits
    assert logits_bytes(1000, 50, 2, "torch", True) == 1000 * 50 * (2 + 8 + 4)
    assert logits_bytes(1000, 50, 2, "chunked", True, 100) == 100 * 50 * 4 * 3
    # One chunk's bf16 logits, whatever the kept count; fewer kept positions than a chunk hold fewer.
    assert logits_bytes(1000, 50, 2, "chunked_fused", True, 100) == 100 * 50 * 2
    assert logits_bytes(60, 50, 2, "chunked_fused", False, 100) == 60 * 50 * 2
    # Within one chunk the plain head runs: float32 logits and softmax on the torch path.
    assert logits_bytes(60, 50, 2, "chunked", True, 100) == 60 * 50 * (2 + 8 + 4)


def test_lora_trains_adapters_over_a_frozen_base():
    inp = MemoryInputs(
        dims=TOY,
        world=1,
        compute_bytes=2,
        update_tokens=10,
        logprob_tokens=10,
        kept_fraction=1.0,
        engine=EngineMemory(0, 0, 0),
        lora_params=100,
    )
    p = estimate_phases(inp)["update"]
    # The base stays in bf16 (2 x 10,000) beside float32 adapters; only the adapters are gathered, get gradients
    # and Adam moments.
    assert p["params"] == 2 * 10_000 + 4 * 100 + 2 * 100
    assert p["optimizer"] == 8 * 100
    assert p["grads"] == 4 * 100 + 2 * 100


def test_a_frozen_vision_tower_keeps_float32_masters_but_no_gradients_or_moments():
    p = estimate_phases(toy_inputs(frozen_params=2_000))["update"]
    assert p["params"] == 4 * 10_000 / 2 + 2 * 10_000  # masters of all of it, and all of it gathered
    assert p["grads"] == 4 * 8_000 / 2 + 2 * 8_000
    assert p["optimizer"] == 8 * 8_000 / 2


def test_a_frozen_tower_gathered_with_the_root_unit_adds_its_copy_but_no_gradients():
    # Layer units: 70% of the model gathered at once, the 2,000-parameter tower among it (it sits in the root).
    p = estimate_phases(toy_inputs(frozen_params=2_000, gathered_fraction=0.7))["update"]
    assert p["params"] == 4 * 10_000 / 2 + 2 * 7_000
    # The update's peak is the reduction of the 5,000 trained parameters gathered: bf16 in, float32 out (2 + 4 B).
    assert p["grads"] == 4 * 8_000 / 2 + (2 + 4) * (7_000 - 2_000)


def test_the_plan_counts_the_tower_in_the_root_unit(tiny_vl_path):
    from hybridrl.plan import memory_inputs

    dims = dataclasses.replace(model_dims(tiny_vl_path), layers=8)  # enough layers for units below the whole
    cfg = RunConfig(model=ModelConfig(name="hf", path=tiny_vl_path))
    cfg.trainer.fsdp_layers_per_unit = 1
    inp = memory_inputs(cfg, dims, 0)
    head = dims.vocab * dims.hidden * (1 if dims.tied else 2)
    assert dims.vision > 0
    assert inp.gathered_fraction == pytest.approx(2 / dims.layers + (head + dims.vision) / dims.params)


def test_the_plan_freezes_the_vision_tower_as_the_trainer_does(tiny_vl_path):
    from hybridrl.models.vision import freeze_vision_tower
    from hybridrl.plan import memory_inputs

    config = transformers.AutoConfig.from_pretrained(tiny_vl_path)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    tower = freeze_vision_tower(model)  # what the trainer freezes, counted on the model itself
    dims = model_dims(tiny_vl_path)
    assert dims.vision == tower and dims.params == sum(p.numel() for p in model.parameters())
    frozen = memory_inputs(RunConfig(model=ModelConfig(name="hf", path=tiny_vl_path)), dims, 0)
    trained = memory_inputs(RunConfig(model=ModelConfig(name="hf", path=tiny_vl_path, freeze_vision=False)), dims, 0)
    assert (frozen.frozen_params, trained.frozen_params) == (tower, 0)


def saved_bytes(model: torch.nn.Module, tokens: int) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward of one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 512, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids, use_cache=False)
    return sum(saved.values())


@pytest.mark.parametrize("dtype, b", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_eager_activation_count_matches_what_torch_saves(dtype, b):
    """Per decoder layer, as torch's saved-tensor hooks see it: the difference between a 3- and a 1-layer model."""
    kw = dict(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    measured = []
    for layers in (1, 3):
        torch.manual_seed(0)
        config = transformers.Qwen2Config(num_hidden_layers=layers, **kw)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        measured.append(saved_bytes(model, 128))
    per_layer = (measured[1] - measured[0]) / 2 / 128
    dims = ModelDims(0, 1, 256, 256, 128, 704, 512, True)
    assert per_layer == pytest.approx(
        activation_bytes_per_token(dims, b, compiled=False, checkpointing=False), rel=0.02
    )


def test_the_1_5b_update_estimate_is_near_the_peak_measured_on_the_h200(shapes):
    """The 1.5B actor's update as measured on one H200: 128 rows, prompt 256 + 512 new, micro-batch 16 rows,
    compiled layers, peak 54 GB; the estimate must be within 15% of it."""
    cfg = RunConfig(
        model=ModelConfig(name="hf", path=shapes["1.5b"]),
        trainer=TrainerConfig(device="cuda", micro_batch_size=16, device_memory_gb=139.8),
    )
    cfg.data.train_batch_size, cfg.data.max_prompt_tokens, cfg.engine.max_new_tokens = 16, 256, 512
    cfg.algorithm.kl_coef = 0.0  # the measurement ran the actor alone
    plan = make_plan(cfg, 139.8 * GiB)
    assert plan.estimate_gb()["update"] * GiB / 1e9 == pytest.approx(54, rel=0.15)
    assert plan.fits


def grpo_7b_on_one_h200(shapes) -> list[str]:
    """The plan's arguments for 7B GRPO, 16 prompts x 8 samples x 256 new tokens, on one H200 (139.8 GiB)."""
    return [
        "model=hf",
        f"model.path={shapes['7b']}",
        "data.train_batch_size=16",
        "engine.max_new_tokens=256",
        "trainer.device=cuda",
        "trainer.device_memory_gb=139.8",
    ]


def test_plan_prints_the_table_and_exits_2_naming_what_fits(shapes, capsys):
    args = grpo_7b_on_one_h200(shapes)
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split()[:3] == ["phase", "params", "grads"]
    assert {"generate", "logprob", "update"} <= {line.split()[0] for line in out.splitlines()[1:4]}
    assert err.count("\n") == 1 and "update phase" in err and "model.lora.rank=64" in err
    assert main([*args[:-1], "trainer.device_memory_gb=1000"]) == 0
    assert "fits: peak" in capsys.readouterr().out


def test_check_fit_raises_before_any_weight_loads_on_a_pretend_device(tiny_path):
    trainer = TrainerConfig(device_memory_gb=1.1, micro_batch_size=64)  # the default run's 64 rows
    cfg = RunConfig(model=ModelConfig(name="hf", path=tiny_path), trainer=trainer)
    # One proposal of each kind: fully trained on this device, LoRA, more devices (each with a token budget here).
    fits = r"these fit: [^|]*max_tokens_per_micro_batch=\d+ \(.*\) \| model\.lora\.rank=64.* \| .*\d devices"
    with pytest.raises(HybridRLError, match=r"GiB more than the .* usable .* " + fits):
        check_fit(cfg)
    assert check_fit(RunConfig(model=ModelConfig(name="hf", path=tiny_path), trainer=TrainerConfig())) is None
    roomy = RunConfig(model=ModelConfig(name="hf", path=tiny_path), trainer=TrainerConfig(device_memory_gb=64))
    assert check_fit(roomy).fits


def test_estimate_sits_beside_the_measured_peaks():
    report = estimate_report({"update": 2.0, "logprob": 1.0}, {"update": {"peak_allocated_gb": 2.5}, "logprob": {}})
    assert report == {"estimate_gb": {"update": 2.0, "logprob": 1.0}, "estimate_ratio": {"update": 1.25}}
    assert json.dumps(report)
    # Trainer state lazy offload kept on the device beside the engine is in the peak, not in what generate needs.
    report = estimate_report({"generate": 2.0}, {"generate": {"peak_allocated_gb": 7.0, "lazily_kept_gb": 4.6}})
    assert report["estimate_ratio"] == {"generate": pytest.approx(1.2)}


def test_a_worker_reports_the_estimate_with_its_memory(tiny_path, tokenizer, process_group):
    from tests.unit.training.test_trainer import make_trainer

    report = make_trainer(tiny_path, tokenizer).memory_report()
    assert set(report["estimate_gb"]) == {"generate", "logprob", "update"}
    assert all(gb > 0 for gb in report["estimate_gb"].values())
    assert "estimate_ratio" not in report  # the CPU measures no device peak


def test_plan_refuses_a_bad_override_in_one_line(capsys):
    assert main(["trainer.lrr=1"]) == 2
    assert main(["trainer.max_tokens_per_micro_batch=-1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "error: trainer.lrr is not a config key (did you mean trainer.lr?)",
        "error: trainer.max_tokens_per_micro_batch must be >= 0, got -1",
    ]


def test_moments_on_the_host_leave_two_streaming_slots_on_the_device():
    from hybridrl.training.host_optimizer import CHUNK_ELEMENTS
    from hybridrl.training.memory_estimate import host_bytes, streaming_slots

    inp = toy_inputs(optimizer_on_host=True)
    p = estimate_phases(inp)
    # The rank's 5,000 trained elements fit one chunk: one slot of both float32 moments; a model of many chunks
    # streams through two slots of a chunk each.
    assert CHUNK_ELEMENTS > 5_000
    assert p["update"]["optimizer"] == 2 * 4 * 5_000
    assert streaming_slots(trained=20 * CHUNK_ELEMENTS, world=2) == 2 * 2 * 4 * CHUNK_ELEMENTS
    assert p["logprob"]["optimizer"] == 0
    assert p["generate"]["params"] == 4 * 10_000 / 2  # the masters alone stay through the rollout
    # The moments sit in host memory instead: 8 bytes per trained parameter on this rank.
    assert host_bytes(inp) == {"actor_optimizer": 8 * 10_000 / 2}
    assert host_bytes(inp.with_(offload=frozenset({"params"}), ref=True, ref_offload=True)) == {
        "actor_optimizer": 8 * 10_000 / 2,
        "actor_params": 4 * 10_000 / 2,
        "ref_params": 2 * 10_000 / 2,
    }


def test_the_gradient_reduction_is_the_update_peak_when_activations_are_small():
    """One rank, one unit: after the whole backward, FSDP2 copies the bf16 gradients into a float32 reduce input
    (2P + 4P bytes at once), then frees them for the float32 output (4P + 4P), beside the accumulated 4P."""
    inp = MemoryInputs(
        dims=TOY,
        world=1,
        compute_bytes=2,
        update_tokens=1,
        logprob_tokens=1,
        kept_fraction=0.0,
        engine=EngineMemory(0, 0, 0),
    )
    p = estimate_phases(inp)["update"]
    assert p["grads"] == 4 * 10_000 + 8 * 10_000
    assert p["activations"] == 0
    assert sum(p.values()) == (4 + 2) * 10_000 + 12 * 10_000 + 8 * 10_000
    # Many tokens: the backward's activations outweigh the reduction again.
    big = estimate_phases(inp.with_(update_tokens=10_000))["update"]
    assert big["grads"] == 4 * 10_000 + 2 * 10_000 and big["activations"] == 304 * 2 * 10_000


def test_7b_full_parameter_grpo_gets_a_fitting_proposal_on_one_h200(shapes, capsys):
    """7B full-parameter GRPO, 16 prompts x 8 x 256, on one H200. The first proposal keeps every parameter trained on
    one device, moves the moments to the host, and fits when applied."""
    args = grpo_7b_on_one_h200(shapes)
    assert main(args) == 2
    err = capsys.readouterr().err
    first = err.split("these fit: ")[1].split(" (")[0]
    assert "trainer.optimizer_on_host=true" in first and "lora" not in first and "devices" not in first
    assert main([*args, *first.split()]) == 0
    out = capsys.readouterr().out
    # 7.6B trained parameters x 8 bytes of moments = 56.74 GiB in host memory.
    assert "fits: peak" in out and "actor optimizer 56.74" in out


def test_partial_rollouts_size_the_kv_cache_for_the_over_sampled_groups():
    """With rollout.partial the engine holds (B + extra) · n sequences at once, each up to prompt + max_new_tokens."""
    from hybridrl.config import DataConfig
    from hybridrl.plan import engine_memory
    from hybridrl.training.memory_estimate import ModelDims

    dims = ModelDims(params=1000, layers=2, hidden=8, q_dim=8, kv_dim=4, intermediate=16, vocab=50, tied=True)
    cfg = RunConfig(data=DataConfig(train_batch_size=4, max_prompt_tokens=10))
    cfg.engine.max_new_tokens, cfg.engine.native.max_batch_size, cfg.algorithm.group_size = 30, 1000, 2
    per_sequence = (10 + 30) * 2 * 2 * 4 * 2  # tokens x (keys, values) x layers x kv_dim x bf16 bytes
    assert engine_memory(cfg, dims, True, None).kv_cache == 4 * 2 * per_sequence
    cfg.rollout.partial.enabled, cfg.rollout.partial.oversample = True, 0.75
    assert engine_memory(cfg, dims, True, None).kv_cache == (4 + 3) * 2 * per_sequence
