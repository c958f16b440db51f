"""Image prompts through the SGLang adapter (against the stand-in engine): each request's `image_data` is its prompt's
processor output as one ``processor_output`` dict, aligned with `input_ids` sample by sample; text prompts in the
same batch carry none and a text batch's payload is unchanged; equal tokens with other pictures are distinct
requests; placeholder counts are checked; and the resharder sends a Qwen2-VL policy to SGLang under the checkpoint's
own names (those SGLang's loader reads at start-up)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hybridrl.data.images import ImageInputs, ImageSource
from hybridrl.engines.base import GenerationRequest, SamplingParams
from hybridrl.engines.config import EngineConfig
from hybridrl.engines.sglang.engine import SglangEngine
from hybridrl.engines.sglang.multimodal import ImageTokens, build_image_data
from hybridrl.errors import HybridRLError
from tests.unit.engines.sglang._fake_sglang import FakeSglangEngine, expected_completions

IMG = 9  # the image placeholder id of the made-up config below


@pytest.fixture
def vl_dir(tmp_path):
    cfg = {"eos_token_id": 2, "image_token_id": IMG, "vision_config": {"spatial_merge_size": 2}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def images(*grids: tuple[int, int, int], seed: int = 0) -> ImageInputs:
    """Made-up processor output: grids (t, h, w) in patches, t*h*w rows of pixel values per image."""
    g = torch.manual_seed(seed)
    rows = sum(t * h * w for t, h, w in grids)
    sources = [ImageSource(name=f"img{seed}-{k}.png", digest=f"{seed:02d}{k:038d}") for k in range(len(grids))]
    return ImageInputs(torch.randn(rows, 12, generator=g), torch.tensor(grids, dtype=torch.long), sources)


def make(path: Path) -> SglangEngine:
    return SglangEngine(str(path), EngineConfig(name="sglang"), device="cpu", engine_factory=FakeSglangEngine)


def placeholders(n: int) -> list[int]:
    return [IMG] * n


def test_each_sample_carries_its_prompts_processor_output(vl_dir):
    eng = make(vl_dir)
    assert eng.takes_images
    two = images((1, 4, 4), (1, 2, 4), seed=1)  # 16 / 4 + 8 / 4 = 6 placeholders (merge 2: 4 patches a token)
    one = images((1, 4, 2), seed=2)  # 2 placeholders
    prompts = [[1, *placeholders(6), 3], [4, 5], [1, *placeholders(2)]]
    params = SamplingParams(n=2, max_new_tokens=3, seed=0)
    out = eng.generate(prompts, params, [two, None, one])
    assert out == expected_completions(prompts, params, [2])  # generation itself is untouched by images
    call = eng._engine.calls[-1][1]
    data = call["image_data"]
    assert len(data) == 6 and call["input_ids"] == [p for p in prompts for _ in range(2)]
    for k, want in enumerate([two, two, None, None, one, one]):
        if want is None:
            assert data[k] == []
            continue
        (item,) = data[k]  # SGLang takes exactly one processor_output dict per request
        assert item["format"] == "processor_output" and set(item) == {"format", "pixel_values", "image_grid_thw"}
        assert torch.equal(item["pixel_values"], want.pixel_values)
        assert item["image_grid_thw"].tolist() == [list(g) for g in want.image_grid_thw.tolist()]


def test_a_text_batch_sends_no_image_data(vl_dir):
    eng = make(vl_dir)
    eng.generate([[1, 2]], SamplingParams(n=2), [None])
    eng.generate([[1, 2]], SamplingParams(n=2))
    assert all("image_data" not in c[1] for c in eng._engine.calls if c[0] == "generate")


def test_requests_and_agent_turns_carry_their_images(vl_dir):
    eng = make(vl_dir)
    pic = images((1, 2, 2), seed=3)
    reqs = [GenerationRequest([1, IMG], 0, 0, images=pic), GenerationRequest([1, 2], 1, 0)]
    eng.generate_requests(reqs, SamplingParams(seed=1))
    data = eng._engine.calls[-1][1]["image_data"]
    assert torch.equal(data[0][0]["pixel_values"], pic.pixel_values) and data[1] == []
    stream = eng.async_engine()
    stream.event_loop.run_until_complete(stream.generate(reqs[0], SamplingParams(seed=1)))
    (item,) = eng._engine.calls[-1][1]["image_data"]  # a single request: its list of one dict
    assert torch.equal(item["image_grid_thw"], pic.image_grid_thw)


def test_equal_tokens_with_other_pictures_are_not_merged(vl_dir):
    """The TP leader generates identical parts of several ranks once: a part's images count by content."""
    eng = make(vl_dir)
    params = SamplingParams(n=1)
    red, blue = images((1, 2, 2), seed=4), images((1, 2, 2), seed=5)
    prompt = [[1, IMG]]
    parts = [(prompt, params, None, [red]), (prompt, params, None, [blue]), (prompt, params, None, [red])]
    eng._generate_parts(parts)
    data = eng._engine.calls[-1][1]["image_data"]
    assert len(data) == 2  # red and blue; the second red is the first's
    assert torch.equal(data[0][0]["pixel_values"], red.pixel_values)
    assert torch.equal(data[1][0]["pixel_values"], blue.pixel_values)


def test_placeholder_count_must_match_the_images(vl_dir):
    eng = make(vl_dir)
    with pytest.raises(HybridRLError, match=r"prompt 0 holds 1 image placeholder tokens .* need 4"):
        eng.generate([[1, IMG]], SamplingParams(), [images((1, 4, 4))])


def test_a_text_model_takes_no_images(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    eng = make(tmp_path)
    assert not eng.takes_images
    with pytest.raises(HybridRLError, match="vision-language model.path"):
        eng.generate([[1, IMG]], SamplingParams(), [images((1, 2, 2))])


def test_image_tokens_of_a_qwen2_vl_config(tiny_vl_path):
    cfg = json.loads((Path(tiny_vl_path) / "config.json").read_text())
    tokens = ImageTokens.from_model(Path(tiny_vl_path))
    assert tokens == ImageTokens(cfg["image_token_id"], cfg["vision_config"]["spatial_merge_size"])
    # 448x448 at 14-pixel patches: a 32x32 grid, 2x2 merged: 256 placeholders (Qwen2-VL's figure for that size).
    assert build_image_data([placeholders(0)], [None], 3, tokens) is None
    assert tokens.expected(images((1, 32, 32))) == 256


@pytest.mark.parametrize("vision", [False, True])
def test_resharder_sends_a_qwen2_vl_policy_under_checkpoint_names(tiny_vl_path, vision):
    """SGLang's Qwen2-VL loader (0.5.23, models/qwen2_vl.py and qwen2_5_vl.py) takes the original checkpoint names:
    ``model.*`` for the decoder, ``visual.*`` for the tower (Qwen2.5-VL's skips any other name without a word); the
    names it reads from the checkpoint at start-up are therefore the names a sync must use."""
    from transformers import AutoModelForImageTextToText

    from hybridrl.reshard.config import ReshardConfig
    from hybridrl.reshard.manager import Resharder

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_path, dtype=torch.float32)
    eng = make(Path(tiny_vl_path))
    Resharder(ReshardConfig(), eng, model.config, vision=vision).sync(model)
    eng.finish_weight_update()
    sent = {name for push in eng._engine.received for name, _ in push[0]}
    with safe_open(str(Path(tiny_vl_path) / "model.safetensors"), "pt") as f:
        on_disk = set(f.keys())
    want = on_disk if vision else {n for n in on_disk if not n.startswith("visual.")}
    assert sent == want
    received = dict(t for push in eng._engine.received for t in push[0])
    with safe_open(str(Path(tiny_vl_path) / "model.safetensors"), "pt") as f:
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
            assert torch.equal(received[name], f.get_tensor(name))
