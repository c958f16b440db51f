"""The fused decoder over a Qwen2-VL language model: image embeddings at the placeholders, multimodal RoPE in the
prompt, and the offset rotary positions of the text after it, against transformers' own forward in float32; the
fused engine's samples of image prompts against the transformers path's.

Runs on CPU; HYBRIDRL_TEST_DEVICE=cuda runs the same tests on a GPU (through the kernels), and CI's interpreted run
the one marked `interpreted` through the kernels on CPU."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

import tests.triton_interpret  # noqa: F401  (HYBRIDRL_KERNELS_ON_CPU=1 TRITON_INTERPRET=1: the kernels on CPU)
from hybridrl.data.images import ImageInputs, ImageSource
from hybridrl.engines.base import SamplingParams
from hybridrl.engines.config import NativeOptions
from hybridrl.engines.native.engine import FusedEngine
from hybridrl.engines.native.kv_cache import blocks_for
from hybridrl.engines.native.vision_hf import VisionHFEngine
from hybridrl.models.vision import MropeIndex, vision_tower
from hybridrl.reshard import ReshardConfig, Resharder
from tests.tiny_models import randomized

IMAGE, START, END = 290, 291, 292
DEVICE = torch.device(os.environ.get("HYBRIDRL_TEST_DEVICE", "cpu"))
TOL = 2e-5 if DEVICE.type == "cpu" else 1e-4  # GPU kernels differ by shape between the two forwards

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_qwen_vl(arch: str = "qwen2_vl", seed: int = 0) -> torch.nn.Module:
    """A random float32 Qwen2-VL or Qwen2.5-VL: head_dim 16 in rotary sections 2/3/3; one vision block (Qwen2.5-VL:
    a windowed one and a full-attention one), 2x2 merge."""
    common = dict(patch_size=14, spatial_merge_size=2, num_heads=2)
    if arch == "qwen2_vl":
        cls, vision = transformers.Qwen2VLConfig, dict(common, depth=1, embed_dim=32, hidden_size=64)
    else:
        cls = transformers.Qwen2_5_VLConfig
        vision = dict(
            common,
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=64,
            window_size=56,
            fullatt_block_indexes=[1],
        )
    config = cls(
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            bos_token_id=None,
            eos_token_id=None,
        ),
        vision_config=vision,
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
        video_token_id=293,
    )
    torch.manual_seed(seed)
    model = randomized(transformers.AutoModelForImageTextToText.from_config(config).float())
    return model.to(DEVICE).eval()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def model(request) -> torch.nn.Module:
    return tiny_qwen_vl(request.param)


def fused(model) -> FusedEngine:
    engine = FusedEngine(model.config, [0], 0, device=DEVICE, dtype=torch.float32, options=NativeOptions(), seed=0)
    Resharder(ReshardConfig(), engine, model.config).sync(model)
    return engine


def picture(h: int, w: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values of one h x w-patch picture (2 frames of 14x14 patches, 3 channels) and its grid [1, 3]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h * w, 3 * 2 * 14 * 14, generator=g).to(DEVICE), torch.tensor([[1, h, w]], device=DEVICE)


def test_a_prompt_with_a_picture_and_the_text_after_it_match_transformers(model):
    pixels, grid = picture(4, 6, seed=1)  # 24 patches, merged 2x2: 6 image tokens
    prompt = [5, 7, START, *[IMAGE] * 6, END, 11, 13, 17]
    follow = [19, 23, 29]  # generated tokens: text, at the prompt's largest position + 1, + 2, ...
    ids = torch.tensor([prompt + follow], device=DEVICE)
    positions = MropeIndex(model)(prompt + follow, grid.cpu()).to(DEVICE)  # [3, L]
    with torch.no_grad():
        want = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, position_ids=positions[:, None]).logits[0]
        embeds = vision_tower(model)(pixels, grid_thw=grid).pooler_output  # [6, hidden]

    engine = fused(model)
    blocks = blocks_for(len(prompt) + len(follow), engine.block_size)
    table = engine.kv_allocator(blocks, blocks).allocate(blocks)
    engine.reserve_width(blocks)
    dec, cache, n = engine.model, engine.cache, len(prompt)
    image_at = torch.tensor([i for i, t in enumerate(prompt) if t == IMAGE], device=DEVICE)
    cos, sin = dec.mrope_rows(positions[:, :n])
    slots = torch.tensor(cache.slots(table, 0, n), device=DEVICE)
    with torch.no_grad():
        logits = dec.prefill(
            ids[:, :n], torch.tensor([n], device=DEVICE), slots[None], cache, (image_at, embeds), (cos, sin)
        )
    assert (logits[0, :300] - want[n - 1]).abs().max().item() < TOL

    # The text after the picture, one token a step: cache position p, rotary position p + the prompt's offset.
    offset = int(positions[0, n]) - n
    block = torch.tensor([table], dtype=torch.int32, device=DEVICE)
    for k, tok in enumerate(follow):
        p = n + k
        with torch.no_grad():
            logits = dec.decode(
                torch.tensor([tok], device=DEVICE),
                torch.tensor([p], device=DEVICE),
                torch.tensor(cache.slots(table, p, p + 1), device=DEVICE),
                block,
                cache,
                p + 1,
                rope_pos=torch.tensor([p + offset], device=DEVICE),
            )
        assert (logits[0, :300] - want[p]).abs().max().item() < TOL, k


def test_mrope_rows_are_the_text_tables_where_the_three_axes_agree(model):
    dec = fused(model).model
    positions = torch.arange(12, device=DEVICE).expand(3, -1)
    cos, sin = dec.mrope_rows(positions)
    assert torch.equal(cos, dec.cos[:12]) and torch.equal(sin, dec.sin[:12])
    assert cos.is_contiguous() and sin.is_contiguous()  # the kernels read a token's row at row × head_dim
    # Column j follows the axis of its section: 2 temporal, 3 height, 3 width, twice (cos and sin halves).
    cos, _ = dec.mrope_rows(torch.tensor([[0], [5], [9]], device=DEVICE))
    axis_pos = torch.tensor([0, 0, 5, 5, 5, 9, 9, 9] * 2, device=DEVICE)
    assert torch.equal(cos[0], dec.cos[axis_pos, torch.arange(16, device=DEVICE)])


def image_inputs(h: int, w: int, seed: int) -> ImageInputs:
    pixels, grid = picture(h, w, seed)
    return ImageInputs(pixels.cpu(), grid.cpu(), [ImageSource(f"picture {seed}", data=b"", digest=f"d{seed}")])


def vl_prompt(words: list[int], tokens: int) -> list[int]:
    return [5, START, *[IMAGE] * tokens, END, *words]


@pytest.mark.parametrize("tower_trains", [pytest.param(False, marks=pytest.mark.interpreted), True])
def test_the_fused_engine_samples_what_the_transformers_path_samples_from_image_prompts(model, tower_trains):
    """Groups of samples sharing one picture's prefill, two pictures in one prompt, a text prompt beside them, and
    prompts with equal tokens but other pictures: greedy and seeded samples equal the transformers path's."""
    two = image_inputs(4, 4, 3)
    two = ImageInputs(
        torch.cat([two.pixel_values, picture(2, 4, 4)[0].cpu()]),
        torch.tensor([[1, 4, 4], [1, 2, 4]]),
        [*two.sources, ImageSource("picture 4", data=b"", digest="d4")],
    )
    prompts = [
        (vl_prompt([11, 13], 6), image_inputs(4, 6, 1)),
        (vl_prompt([11, 13], 6), image_inputs(4, 6, 2)),  # the same tokens, another picture: another prompt
        ([5, 17, 19, 23], None),
        ([5, START, *[IMAGE] * 4, END, START, *[IMAGE] * 2, END, 29], two),
    ]
    engine = FusedEngine(
        model.config, [0], 0, device=DEVICE, dtype=torch.float32, options=NativeOptions(), tower_trains=tower_trains
    )
    Resharder(ReshardConfig(), engine, model.config, vision=True).sync(model)
    reference = VisionHFEngine(model, [0], 0)
    for params in (
        SamplingParams(n=3, max_new_tokens=6, temperature=0.0),
        SamplingParams(n=3, max_new_tokens=6, temperature=1.0, seed=7),
    ):
        ids, images = [p for p, _ in prompts], [i for _, i in prompts]
        got = engine.generate(ids, params, images)
        want = reference.generate(ids, params, images)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert got[0].token_ids != got[3].token_ids  # the pictures, not the tokens, part prompts 0 and 1
        for a, b in zip(got, want):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    # The samples of a prompt shared its image prefill: one forward per prompt, not per sample.
    assert engine.scheduler.prefilled_tokens == 2 * sum(len(p) for p, _ in prompts)


@pytest.mark.interpreted
def test_image_prompts_continue_their_cached_prefix_by_picture(model):
    """The prefix table keys image blocks on the picture's content: an agent's next turn finds its first turn's
    blocks and computes only its new tokens; a prompt whose cached prefix ends inside a picture's placeholders runs
    the tower and computes the rest of them; equal tokens with another picture find nothing. Every sample equals the
    transformers path's over the whole prompt."""
    engine = FusedEngine(model.config, [0], 0, device=DEVICE, dtype=torch.float32, options=NativeOptions(), seed=0)
    Resharder(ReshardConfig(), engine, model.config, vision=True).sync(model)
    reference = VisionHFEngine(model, [0], 0)
    bs, greedy = engine.block_size, SamplingParams(n=1, max_new_tokens=6, temperature=0.0)
    pic = image_inputs(8, 12, 1)  # 24 placeholders at positions 2..25: past the first block of 16
    assert bs == 16

    def run(prompt: list[int], images: ImageInputs, computed: int) -> list[int]:
        before = engine.scheduler.prefilled_tokens
        (got,) = engine.generate([prompt], greedy, [images])
        (want,) = reference.generate([prompt], greedy, [images])
        assert got.token_ids == want.token_ids
        assert max(abs(x - y) for x, y in zip(got.logprobs, want.logprobs)) < 1e-4
        assert engine.scheduler.prefilled_tokens - before == computed
        return got.token_ids

    first = vl_prompt([11], 24)  # 28 tokens
    sampled = run(first, pic, len(first))
    second = first + sampled + [17, 19, 23]  # the next turn: the first's K/V are final up to its last sample
    run(second, pic, len(second) - (len(first) + len(sampled) - 1) // bs * bs)
    third = vl_prompt([13, 17], 24)  # its first block (with the picture's first placeholders) is cached
    run(third, pic, len(third) - bs)
    run(third, image_inputs(8, 12, 2), len(third))  # another picture: nothing cached
