"""A prompt's images as SGLang's `image_data`: the HF processor's output, which SGLang takes as it is.

SGLang 0.5.23 reads a request's images in one of three forms (`Engine.generate`'s `image_data`,
`multimodal/processors/base_processor.py`): raw images (it runs the HF processor itself, after decoding the prompt
to text and tokenizing it again, which needs the tokenizer that `skip_tokenizer_init=True` drops), a
``{"format": "processor_output", ...}`` dict, or precomputed embeddings. We send the processor's output,
the very `pixel_values` and `image_grid_thw` the trainer reads (`hybridrl.data.images.ImageInputs`), with
`input_ids` already holding each image's placeholder tokens, expanded. SGLang then takes the ids unchanged (its
fast path for preprocessed input), computes mrope positions from them and the grids (`get_rope_index`), and keys its
radix cache by the features' hash, so equal tokens with other pictures never share a prefix.

Wire shape, per request (prompt-major, ``n`` per prompt, aligned with `input_ids`)::

    image_data = [[{"format": "processor_output", "pixel_values": [patches, dim], "image_grid_thw": [images, 3]}],
                  [],          # a text prompt in the same batch: no images
                  ...]

A prompt's images travel as exactly one dict (SGLang refuses a list of several preprocessed items); with two
images, `pixel_values` holds both, image after image, and `image_grid_thw` has two rows (SGLang splits them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.data.images import ImageInputs
from hybridrl.errors import HybridRLError

PROCESSOR_OUTPUT = "processor_output"


@dataclass(frozen=True)
class ImageTokens:
    """What a vision-language checkpoint's config says about its image placeholders."""

    image_token_id: int
    """The placeholder token of one image patch group (``<|image_pad|>`` in Qwen2-VL)."""
    merge: int
    """Patches merged into one placeholder per side (`vision_config.spatial_merge_size`): merge² per token."""

    @classmethod
    def from_model(cls, path: Path) -> ImageTokens | None:
        """Read from `path`/config.json; None for a model without a vision tower (no `vision_config`)."""
        f = path / "config.json"
        if not f.is_file():
            return None
        cfg = json.loads(f.read_text())
        if "vision_config" not in cfg or "image_token_id" not in cfg:
            return None
        return cls(int(cfg["image_token_id"]), int(cfg["vision_config"].get("spatial_merge_size", 2)))

    def expected(self, images: ImageInputs) -> int:
        """How many placeholder tokens the prompt of `images` must hold: one per merge² patches of each image."""
        return int(images.image_grid_thw.prod(dim=-1).sum()) // (self.merge * self.merge)


def image_item(images: ImageInputs) -> list[dict[str, Any]]:
    """One request's `image_data` entry: its prompt's images as a single processor-output dict."""
    return [{"format": PROCESSOR_OUTPUT, "pixel_values": images.pixel_values, "image_grid_thw": images.image_grid_thw}]


def build_image_data(
    prompts: Sequence[Sequence[int]],
    images: Sequence[ImageInputs | None] | None,
    repeats: int,
    tokens: ImageTokens | None,
) -> list[list[dict[str, Any]]] | None:
    """`image_data` for the requests of `prompts`, each prompt repeated `repeats` times (its samples), prompt-major;
    None when no prompt has images (the request then carries no `image_data`, as a text model's).

    HybridRLError when the model takes no images (`tokens` None), or when a prompt's placeholders and its images
    disagree in number (SGLang would fail deep in its scheduler or splice the wrong rows)."""
    if images is None or all(x is None for x in images):
        return None
    if len(images) != len(prompts):
        raise HybridRLError(f"SGLang engine: {len(images)} image entries for {len(prompts)} prompts")
    if tokens is None:
        raise HybridRLError(
            "SGLang engine: prompts carry images but the model's config.json has no vision_config/image_token_id; "
            "images need a vision-language model.path (Qwen2-VL, Qwen2.5-VL)"
        )
    out: list[list[dict[str, Any]]] = []
    for i, (prompt, x) in enumerate(zip(prompts, images, strict=True)):
        if x is None:
            out += [[] for _ in range(repeats)]
            continue
        have = sum(1 for t in prompt if int(t) == tokens.image_token_id)
        want = tokens.expected(x)
        if have != want:
            raise HybridRLError(
                f"SGLang engine: prompt {i} holds {have} image placeholder tokens (id {tokens.image_token_id}) but its "
                f"{len(x)} image(s) need {want} (grids {x.image_grid_thw.tolist()}); expand each placeholder with "
                "the processor's image_grid_thw before generating"
            )
        item = image_item(x)
        out += [item for _ in range(repeats)]
    return out
