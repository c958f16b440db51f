"""A vision-language policy (the tiny Qwen2-VL) end to end in one worker: the engine's log-probs on image prompts
equal the trainer's packed forward (images per sequence, mrope positions from the model's own get_rope_index) to
1e-4 in float32, for a group of samples sharing one image prefill, two images in one prompt, and two prompts with
equal tokens but other pictures; an update moves the policy, leaves the frozen tower alone (or, with
model.freeze_vision=false, trains it), and the resharded engine follows it."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image

from hybridrl.algorithms import AlgorithmConfig
from hybridrl.config import RunConfig
from hybridrl.data.config import DataConfig
from hybridrl.data.prompts import load_prompts
from hybridrl.engines.base import SamplingParams
from hybridrl.engines.config import EngineConfig
from hybridrl.errors import ConfigError
from hybridrl.models.config import ModelConfig
from hybridrl.models.image_processor import VisionProcessor
from hybridrl.models.loading import load_tokenizer
from hybridrl.models.tiny_vl import ensure_tiny_vl_model
from hybridrl.models.vision import is_vision_param
from hybridrl.rollout.scoring import completions_to_batch, prompt_images
from hybridrl.training.config import TrainerConfig
from hybridrl.training.vision import check_vision_training
from hybridrl.workers.worker import HybridWorker


def picture(colour, size=(112, 112), square=None) -> bytes:
    img = Image.new("RGB", size, (255, 255, 255))
    if square:
        img.paste(colour, square)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_worker(path: str, freeze_vision: bool = True) -> HybridWorker:
    cfg = RunConfig(
        model=ModelConfig(name="hf", path=path, freeze_vision=freeze_vision),
        trainer=TrainerConfig(lr=1e-2, micro_batch_size=3),
        algorithm=AlgorithmConfig(group_size=4),
        engine=EngineConfig(temperature=1.0),
        data=DataConfig(train_batch_size=2),
    )
    return HybridWorker(cfg)


@pytest.fixture(params=["qwen2_vl", "qwen2_5_vl"])
def worker(request, tiny_vl_path, _cache_dir, process_group):
    path = tiny_vl_path
    if request.param == "qwen2_5_vl":  # windowed vision attention, gated vision MLP
        path = str(ensure_tiny_vl_model(_cache_dir, arch="qwen2_5_vl"))
    return make_worker(path)


@pytest.fixture()
def prompts(tmp_path, worker):
    return image_prompts(tmp_path, worker)


def image_prompts(tmp_path, worker):
    """Three prompts: one picture, the same question about another picture, and two pictures in one prompt."""
    (tmp_path / "red.png").write_bytes(picture((220, 40, 40), square=(0, 0, 56, 56)))
    (tmp_path / "blue.png").write_bytes(picture((40, 80, 220), square=(56, 28, 112, 84)))
    (tmp_path / "wide.png").write_bytes(picture((40, 170, 60), size=(84, 56), square=(0, 0, 28, 28)))
    rows = [
        {"prompt": "<image>What colour is the shape?", "images": "red.png"},
        {"prompt": "<image>What colour is the shape?", "images": "blue.png"},  # equal tokens, another picture
        {"prompt": "<image> then <image>: which has more?", "images": ["wide.png", "red.png"]},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    vision = VisionProcessor(worker.cfg.model.path)
    tokenizer = load_tokenizer(worker.cfg.model.path)
    train, _ = load_prompts(DataConfig(name="jsonl", path=str(path)), tokenizer, vision=vision)
    return train, vision


def rollout(worker, prompts, vision, n=4, temperature=1.0, seed=0):
    images = prompt_images(prompts, vision)
    params = SamplingParams(n=n, temperature=temperature, max_new_tokens=6, seed=seed, stop_token_ids=vision.stop_ids)
    comps = worker.roles.rollout.generate([p.token_ids for p in prompts], params, images)
    return completions_to_batch(prompts, comps, images)


def test_engine_and_trainer_logprobs_agree_on_image_prompts(worker, prompts):
    train, vision = prompts
    assert train[0].token_ids == train[1].token_ids and train[0].images[0].digest != train[1].images[0].digest
    batch = rollout(worker, train, vision)
    assert len(batch) == 12 and batch.meta["image_names"][8] == ["wide.png", "red.png"]
    out = worker.logprob(batch)
    mask = batch["response_mask"].bool()
    diff = (out["old_logprobs"] - batch["engine_logprobs"]).abs()[mask]
    assert diff.max().item() < 1e-4, diff.max()
    assert torch.allclose(out["ref_logprobs"], out["old_logprobs"], atol=1e-6)


def test_each_prompt_is_read_with_its_own_picture(worker, prompts):
    """Greedy continuations of equal tokens with other pictures score differently in both the engine and the
    trainer: a prefill keyed by tokens alone, or images given to the wrong sequence, would make them equal."""
    train, vision = prompts
    batch = rollout(worker, train[:2], vision, n=1, temperature=0.0)
    swapped = batch.select([0, 1])
    swapped.meta["images"] = list(reversed(batch.meta["images"]))
    swapped.tensors["responses"] = batch["responses"]
    own = worker.logprob(batch)["old_logprobs"]
    other = worker.logprob(swapped)["old_logprobs"]
    mask = batch["response_mask"].bool()
    assert (own - batch["engine_logprobs"]).abs()[mask].max() < 1e-4
    assert (own - other).abs()[mask].max() > 1e-4


def update_once(worker, train, vision) -> tuple[dict, dict]:
    """One update on a rollout of `train` with advantages spread over -1..1; the actor's parameters before and
    after."""
    batch = rollout(worker, train, vision)
    batch.tensors["advantages"] = (
        torch.linspace(-1, 1, len(batch))[:, None].expand_as(batch["response_mask"]) * (batch["response_mask"])
    )
    batch.tensors.update(worker.logprob(batch))
    before = {n: t.clone() for n, t in worker.roles.actor.iter_full_params()}
    worker.update(batch)
    return before, dict(worker.roles.actor.iter_full_params())


def engine_follows(worker, train, vision) -> None:
    """After a reshard, a new rollout's engine log-probs equal the updated trainer's."""
    worker.reshard()
    again = rollout(worker, train, vision, seed=1)
    out = worker.logprob(again)
    mask = again["response_mask"].bool()
    assert (out["old_logprobs"] - again["engine_logprobs"]).abs()[mask].max() < 1e-4


def changed(before: dict, after: dict, names: list[str]) -> list[bool]:
    return [not torch.equal(before[n], after[n]) for n in names]


def test_update_trains_the_language_model_and_leaves_the_frozen_tower(worker, prompts):
    train, vision = prompts
    before, after = update_once(worker, train, vision)
    tower = [n for n in before if is_vision_param(n)]
    language = [n for n in before if n not in tower]
    assert tower and not any(changed(before, after, tower))
    assert any(changed(before, after, language))
    engine_follows(worker, train, vision)


def test_a_trained_tower_reaches_the_engine(tiny_vl_path, process_group, tmp_path):
    """model.freeze_vision=false: the update moves the tower too, and the resharder sends it to the engine."""
    worker = make_worker(tiny_vl_path, freeze_vision=False)
    train, vision = image_prompts(tmp_path, worker)
    before, after = update_once(worker, train, vision)
    assert any(changed(before, after, [n for n in before if is_vision_param(n)]))
    engine_follows(worker, train, vision)


def test_unsupported_trainer_layouts_are_refused_by_key():
    with pytest.raises(ConfigError, match="trainer.padding_free=false"):
        check_vision_training(padding_free=False)
    with pytest.raises(ConfigError, match="trainer.sequence_parallel_size=2"):
        check_vision_training(padding_free=True, sequence_parallel_size=2)


def test_an_engine_that_does_not_take_images_is_refused_at_setup(tiny_vl_path, monkeypatch):
    from types import SimpleNamespace

    from hybridrl.models.loading import load_hf_config
    from hybridrl.workers import build

    monkeypatch.setattr(build, "build_engine", lambda *a, **k: SimpleNamespace(takes_images=False))
    cfg = RunConfig(model=ModelConfig(name="hf", path=tiny_vl_path), engine=EngineConfig(name="vllm"))
    policy = SimpleNamespace(config=load_hf_config(tiny_vl_path))
    with pytest.raises(ConfigError, match="engine=vllm: this engine does not take image prompts.*engine=native"):
        build.build_rollout(cfg, tiny_vl_path, None, torch.device("cpu"), cfg.topology(), policy)


@pytest.mark.parametrize("rollout", ["partial", "agent"])
def test_rollouts_that_do_not_hold_images_are_refused_at_setup(tiny_vl_path, monkeypatch, rollout):
    from types import SimpleNamespace

    from hybridrl.models.loading import load_hf_config
    from hybridrl.rollout.config import PartialConfig, RolloutConfig
    from hybridrl.workers import build

    monkeypatch.setattr(build, "build_engine", lambda *a, **k: SimpleNamespace(takes_images=True))
    rollout_cfg = (
        RolloutConfig(partial=PartialConfig(enabled=True)) if rollout == "partial" else RolloutConfig(name="agent")
    )
    cfg = RunConfig(model=ModelConfig(name="hf", path=tiny_vl_path), rollout=rollout_cfg)
    policy = SimpleNamespace(config=load_hf_config(tiny_vl_path))
    key = "rollout.partial.enabled=true" if rollout == "partial" else "rollout=agent"
    with pytest.raises(ConfigError, match=f"{key}: carried samples and agent turns do not hold images"):
        build.build_rollout(cfg, tiny_vl_path, None, torch.device("cpu"), cfg.topology(), policy)
