"""Vision-language policies in the trainer: the frozen tower, and images inside packed micro-batches.

A packed micro-batch (`training/packing.py`) lays its sequences end to end in one row. A vision-language row adds
what the model's own forward reads, each image belonging to its sequence::

    pixel_values     [patches, D]    every sequence's images, sequence after sequence (in placeholder order)
    image_grid_thw   [images, 3]     their grids, in the same order
    position_ids     [4, 1, T]       row 0: text positions restarting at each sequence (what keeps attention inside a
                                     sequence); rows 1-3: mrope's (temporal, height, width) positions of each
                                     sequence, from the model's own `get_rope_index` over that sequence's prompt,
                                     its response continuing the prompt's last position one token at a time

transformers' Qwen-VL forward takes this [4, ...] form for packed input: it embeds the tokens, runs the vision tower
over `pixel_values`, puts each image's embeddings at its placeholder tokens, and rotates by rows 1-3. The vision
tower attends image by image with sdpa: the packed attention's sequence boundaries are the text's, not the tower's.

Placeholder tokens (image, video) the policy sampled end its sample (the controller makes them stop tokens); such a
last token is never read as an input by any position that is scored, so it enters the trainer's forward as the pad
token, which keeps the forward's image count equal to the prompts'.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from hybridrl.batch import Batch
from hybridrl.data.images import ImageInputs, image_key
from hybridrl.errors import ConfigError
from hybridrl.models.config import ModelConfig
from hybridrl.models.vision import (
    MropeIndex,
    freeze_vision_tower,
    is_vision_language,
    placeholder_ids,
    tower_trains,
    vision_tower,
)
from hybridrl.training.packing import PackedRows

log = logging.getLogger(__name__)

#: A vision-language model's LoRA exclusion (`peft.LoraConfig.exclude_modules`): no adapter inside the vision tower.
VISION_MODULES = r"(.*\.)?visual\..*"


def prepare_policy(model: nn.Module, model_cfg: ModelConfig, trains: bool) -> None:
    """A vision-language model as a role holds it: the tower frozen when it does not train (`model.freeze_vision`,
    and always for the reference), attending image by image with sdpa whatever the language model's attention."""
    if not is_vision_language(model.config):
        return
    tower = vision_tower(model)
    if not trains or not tower_trains(model_cfg):
        n = freeze_vision_tower(model)
        if trains:
            log.info("vision tower and projector frozen (model.freeze_vision=true): %.3gM parameters", n / 1e6)
    if hasattr(tower, "set_attn_implementation"):
        tower.set_attn_implementation("sdpa")
    TowerOncePerImage(model)


def vision_packer(model: nn.Module) -> VisionPacker | None:
    """The packer of a vision-language model's micro-batches; None for a text model."""
    return VisionPacker(model) if is_vision_language(model.config) else None


class VisionPacker:
    """Adds a micro-batch's images and mrope positions to its packed row (module doc)."""

    def __init__(self, model: nn.Module) -> None:
        self.mrope = MropeIndex(model)
        self.placeholders = placeholder_ids(model.config)
        self.merge = int(model.config.vision_config.spatial_merge_size)

    def pack(self, packed: PackedRows, batch: Batch, lengths: list[int], pad_id: int) -> PackedRows:
        """`packed` (`pack_rows` of `batch`'s rows, `lengths` response tokens each) with its images added."""
        images: list[ImageInputs | None] = batch.meta.get("images") or [None] * len(batch)
        starts = packed.cu_seqlens.tolist()
        mrope = packed.position_ids.expand(3, -1).clone()  # [3, T]: the tail keeps its plain positions
        input_ids = packed.input_ids.clone()
        placeholders = torch.tensor(self.placeholders)
        heads: dict[tuple, torch.Tensor] = {}  # a group's rows share their prompt's positions
        for i, (prompt, r) in enumerate(zip(batch.prompts, lengths)):
            key = (tuple(prompt), image_key(images[i]))
            if key not in heads:
                heads[key] = self.mrope(prompt, None if images[i] is None else images[i].image_grid_thw)
            head = heads[key]
            # The response is text: it continues from the prompt's largest position, one token at a time.
            tail = (head.max() + 1 + torch.arange(r)).expand(3, -1)
            start = starts[i]
            mrope[:, start : start + len(prompt) + r] = torch.cat([head, tail], dim=1)
            response = input_ids[0, start + len(prompt) : start + len(prompt) + r]
            response[torch.isin(response, placeholders)] = pad_id  # a view: writes into input_ids
        extra = {"position_ids": torch.cat([packed.position_ids, mrope])[:, None, :]}  # [4, 1, T]
        present = [x for x in images if x is not None]
        if present:
            extra.update(self._images(present))
        return dataclasses.replace(packed, input_ids=input_ids, extra=extra)

    def _images(self, present: list[ImageInputs]) -> dict[str, torch.Tensor]:
        """The forward's image inputs: every sequence's grids in order (what its placeholders and positions follow),
        the pixels of each distinct picture once, and which of the tower's output tokens each placeholder takes
        (`TowerOncePerImage` reads the last two)."""
        pixels, grids, index = [], [], []
        seen: dict[str, tuple[int, int]] = {}  # picture -> (first output token, tokens) in the tower's output
        out_tokens = 0
        for x in present:
            offset = 0
            for k, source in enumerate(x.sources):
                grid = x.image_grid_thw[k]
                patches = int(grid.prod())
                tokens = patches // self.merge**2
                key = source.digest or f"id:{id(source)}"
                if key not in seen:
                    seen[key] = (out_tokens, tokens)
                    pixels.append(x.pixel_values[offset : offset + patches])
                    grids.append(grid)
                    out_tokens += tokens
                first, _ = seen[key]
                index.append(torch.arange(first, first + tokens))
                offset += patches
        return {
            "pixel_values": torch.cat(pixels),
            "image_grid_thw": torch.cat([x.image_grid_thw for x in present]),
            TowerOncePerImage.GRID: torch.stack(grids),
            TowerOncePerImage.INDEX: torch.cat(index),
        }


class TowerOncePerImage:
    """Runs the vision tower once per distinct picture of a forward, however many sequences show it (a GRPO group's
    samples all do): the packed forward passes each picture's pixels once, with two inputs of its own that this
    takes out of the call before the model sees them::

        model(..., pixel_values=<distinct pictures>, image_grid_thw=<every sequence's grids>,
              vision_grid_distinct=<the distinct pictures' grids>, vision_token_index=<output token per placeholder>)
        tower(pixel_values, grid_thw)   → runs on the distinct grids; its merged output is gathered by the index
                                          into every placeholder's token (gradients add up over the copies)
    """

    GRID = "vision_grid_distinct"
    INDEX = "vision_token_index"

    def __init__(self, model: nn.Module) -> None:
        self.plan: tuple[torch.Tensor, torch.Tensor] | None = None
        model.register_forward_pre_hook(self._take_plan, with_kwargs=True)
        tower = vision_tower(model)
        tower.register_forward_pre_hook(self._distinct_grid, with_kwargs=True)
        tower.register_forward_hook(self._expand, with_kwargs=True)

    def _take_plan(self, module, args, kwargs):
        grid, index = kwargs.pop(self.GRID, None), kwargs.pop(self.INDEX, None)
        self.plan = (grid, index) if grid is not None else None
        return args, kwargs

    def _distinct_grid(self, module, args, kwargs):
        if self.plan is None:
            return None
        if "grid_thw" in kwargs:
            kwargs["grid_thw"] = self.plan[0]
        else:
            args = (args[0], self.plan[0], *args[2:])
        return args, kwargs

    def _expand(self, module, args, kwargs, output):
        if self.plan is None:
            return None
        index = self.plan[1]
        if isinstance(output, torch.Tensor):  # older transformers: the tower returns the merged tokens
            return output.index_select(0, index)
        output.pooler_output = output.pooler_output.index_select(0, index)
        deep = getattr(output, "deepstack_features", None)  # Qwen3-VL: merged features of early layers too
        if deep:
            output.deepstack_features = [f.index_select(0, index) for f in deep]
        return output


def check_vision_training(padding_free: bool, sequence_parallel_size: int = 1) -> None:
    """What the trainer does not do with a vision-language policy yet, refused by the key to change."""
    if not padding_free:
        raise ConfigError(
            "trainer.padding_free=false: a vision-language policy trains on packed micro-batches only (images and "
            "mrope positions per sequence); leave trainer.padding_free=true"
        )
    if sequence_parallel_size > 1:
        raise ConfigError(
            f"trainer.sequence_parallel_size={sequence_parallel_size}: a vision-language policy's images and mrope "
            "positions are not sliced over a sequence-parallel group; set trainer.sequence_parallel_size=1"
        )
