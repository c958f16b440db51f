"""The model's image processor and its placeholder rule: how many tokens an image takes in the prompt, and the
pixel values its vision tower reads.

Loaded from the model folder through `AutoImageProcessor.from_pretrained`, as for any Hub checkpoint. transformers'
`AutoProcessor` for Qwen2-VL also builds a video processor, which needs torchvision; the image path needs only the
image processor and the tokenizer, so those two are loaded and the processor's own rule is applied here: the chat
template writes one ``<|image_pad|>`` per image, and it stands for t·h·w / merge² tokens (one per merged 2×2 block of
patches), the size of the image's grid after `smart_resize`::

    vision = VisionProcessor(model_path)
    ids = vision.expand(ids, [vision.tokens_for(s.size) for s in sources], where)   # at the data check
    inputs = vision.process(sources)                                                # once per rollout
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from hybridrl.data.images import ImageInputs, ImageSource
from hybridrl.errors import HybridRLError
from hybridrl.models.vision import image_token_ids


class VisionProcessor:
    """A vision-language model's image processor, its placeholder tokens and its chat template."""

    def __init__(self, model_path: str, trust_remote_code: bool = False) -> None:
        from transformers import AutoImageProcessor

        from hybridrl.models.loading import load_hf_config

        self.processor = AutoImageProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        ids = image_token_ids(load_hf_config(model_path, trust_remote_code))
        self.image_token_id = ids["image_token_id"]
        self.vision_start_id = ids.get("vision_start_token_id")
        self.vision_end_id = ids.get("vision_end_token_id")
        self.merge = int(getattr(self.processor, "merge_size", 2))
        #: Placeholder tokens a sample must stop at (`models.vision.placeholder_ids`; the trainer's reason in
        #: training/vision.py): added to every rollout's stop tokens.
        self.stop_ids = [i for i in (self.image_token_id, ids.get("video_token_id")) if i is not None]
        self.chat_template = processor_chat_template(model_path)

    def tokens_for(self, size: tuple[int, int]) -> int:
        """Placeholder tokens an image of (width, height) pixels takes: its patches after resizing, over merge²."""
        width, height = size
        count = getattr(self.processor, "get_number_of_image_patches", None)
        if count is not None:
            patches = int(count(height, width, {}))
        else:  # older image processors: the grid of a blank image of that size
            from PIL import Image

            grid = self.processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"]
            patches = int(grid.prod())
        return patches // (self.merge**2)

    def process(self, sources: Sequence[ImageSource]) -> ImageInputs:
        """Decode, resize and patch the images (once per rollout: the engine and the trainer read the result)."""
        out = self.processor(images=[s.load() for s in sources], return_tensors="pt")
        grid = out["image_grid_thw"].long()
        inputs = ImageInputs(out["pixel_values"].float(), grid, list(sources))
        expected = [self.tokens_for(s.size) for s in sources]
        got = (grid.prod(-1) // self.merge**2).tolist()
        if got != expected:  # the placeholders were counted from the sizes at the data check
            raise HybridRLError(
                f"image processor: images {inputs.names} gave {got} tokens, the prompt was built for {expected}"
            )
        return inputs

    def expand(self, ids: list[int], counts: Sequence[int], where: str) -> list[int]:
        """`ids` with its k-th image placeholder repeated `counts[k]` times; HybridRLError naming `where` when the
        prompt's placeholders and the row's images differ in number."""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(counts):
            raise HybridRLError(
                f"{where}: the rendered prompt has {len(at)} image placeholder(s), the row {len(counts)} image(s); "
                "mark each image once (an {'type': 'image'} part, or <image> in the text)"
            )
        out: list[int] = []
        start = 0
        for i, n in zip(at, counts):
            out += ids[start:i] + [self.image_token_id] * n
            start = i + 1
        return out + ids[start:]


def vision_processor(model_cfg) -> VisionProcessor | None:
    """The `VisionProcessor` of the configured policy when it takes images, else None (decided from config.json)."""
    from hybridrl.models.loading import load_hf_config, resolve_model_path
    from hybridrl.models.vision import is_vision_language

    path = resolve_model_path(model_cfg)
    if not is_vision_language(load_hf_config(path, model_cfg.trust_remote_code)):
        return None
    return VisionProcessor(path, model_cfg.trust_remote_code)


def processor_chat_template(model_path: str) -> str | None:
    """The processor's chat template (chat_template.json or .jinja beside the weights), which renders image parts;
    None when the folder has neither (the tokenizer's own template is used)."""
    folder = Path(model_path)
    as_json = folder / "chat_template.json"
    if as_json.is_file():
        template = json.loads(as_json.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            return template
    as_jinja = folder / "chat_template.jinja"
    return as_jinja.read_text(encoding="utf-8") if as_jinja.is_file() else None
