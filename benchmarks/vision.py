"""Vision-language shapes for `benchmarks.step --vl`: a random-init Qwen2.5-VL folder (config, weights, the tiny
byte-level tokenizer with the vision tokens, the image processor's config, the image chat template), prompts with one
random picture each, and the vision tower's time inside the rollout.

    python -m benchmarks.step --vl 3b --image-size 448 --prompts 16 --group 8 --new-tokens 256   # one H200
    python -m benchmarks.step --vl tiny --image-size 112 --device cpu --prompts 2 --group 2 --new-tokens 8

Each prompt is --prompt-len random text tokens after one image block: a --image-size² picture of random pixels is
(image-size / 28)² image tokens (448: 256), as Qwen2.5-VL's processor counts them.
"""

from __future__ import annotations

import io
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import random_prompts
from hybridrl.data.images import ImageSource
from hybridrl.data.prompts import Prompt

# (text: hidden, layers, heads, kv heads, MLP, vocab; vision: depth, width, heads, MLP, full-attention blocks)
VL_SHAPES = {
    "tiny": ((64, 2, 2, 1, 192, 1000), (2, 32, 2, 64, [1])),
    # Qwen2.5-VL-3B-Instruct's config.json
    "3b": ((2048, 36, 16, 2, 11008, 151936), (32, 1280, 16, 3420, [7, 15, 23, 31])),
}


def vl_config(shape: str, tokenizer):
    """The Qwen2_5_VLConfig of `shape` (bf16, mrope sections and window attention as the released model's)."""
    import transformers

    from hybridrl.models.tiny_vl import VISION_TOKENS, mrope_section

    (h, n, heads, kv, inter, vocab), (depth, width, vheads, vinter, full) = VL_SHAPES[shape]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=max(vocab, len(tokenizer)),
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            intermediate_size=inter,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope_section(h // heads)},
            tie_word_embeddings=True,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=depth,
            hidden_size=width,
            num_heads=vheads,
            intermediate_size=vinter,
            out_hidden_size=h,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=full,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


def make_vl_model_dir(shape: str, image_size: int, device: torch.device, root: str | None = None) -> str:
    """The model folder to run: `root` when it holds a model, else a random-init bf16 Qwen2.5-VL of `shape` with
    its tokenizer and processor files, saved to `root` or a temporary folder."""
    import transformers

    from hybridrl.models.tiny_vl import VL_CHAT_TEMPLATE, build_vl_tokenizer, preprocessor_config

    folder = Path(root or tempfile.mkdtemp(prefix=f"bench_vl_{shape}_"))
    if (folder / "config.json").exists():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vl_tokenizer()
    config = vl_config(shape, tokenizer)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives the tied head storage of its own
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    spec = {"arch": "qwen2_5_vl", "image_size": image_size}
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(spec), indent=2) + "\n")
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": VL_CHAT_TEMPLATE}) + "\n")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return str(folder)


def vl_prompts(n: int, prompt_len: int, image_size: int, model_dir: str) -> list[Prompt]:
    """`n` prompts: an image block of one random `image_size`² picture (its placeholders expanded), then
    `prompt_len` random text tokens."""
    from PIL import Image

    from hybridrl.models.image_processor import VisionProcessor
    from hybridrl.models.loading import load_hf_config

    vision = VisionProcessor(model_dir)
    vocab = load_hf_config(model_dir).get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    out = []
    for i, text in enumerate(random_prompts(n, prompt_len, vocab)):
        pixels = torch.randint(0, 256, (image_size, image_size, 3), generator=g, dtype=torch.uint8).numpy()
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        image = ImageSource(name=f"random-{i}.png", data=buf.getvalue())
        image.check(f"benchmark prompt {i}")
        block = [vision.vision_start_id, *[vision.image_token_id] * vision.tokens_for(image.size), vision.vision_end_id]
        out.append(Prompt(block + text, "", {}, [image]))
    return out


class TowerTimer:
    """Seconds the engine's vision tower runs (device-synchronized around each call; `take` after each step): the
    tower's share of the rollout. The hooks sit on the engine's model only, so the trainer's passes are not
    counted."""

    def __init__(self, engine, device: torch.device) -> None:
        from hybridrl.models.vision import vision_tower

        self.device, self.seconds, self._t0 = device, 0.0, 0.0
        tower = getattr(engine, "vision", None)  # the fused engine's own tower
        if tower is None:
            model = getattr(engine, "model", None)
            if model is None:
                raise SystemExit("--vl: the engine holds no vision tower to time (engine=native)")
            tower = vision_tower(model)  # the transformers path's model
        tower.register_forward_pre_hook(self._start)
        tower.register_forward_hook(self._stop)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _start(self, *_):
        self._sync()
        self._t0 = time.perf_counter()

    def _stop(self, *_):
        self._sync()
        self.seconds += time.perf_counter() - self._t0

    def take(self) -> float:
        """Seconds since the last call."""
        out, self.seconds = self.seconds, 0.0
        return out
