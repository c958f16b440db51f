"""The native engine's transformers path over a vision-language model (Qwen2-VL, Qwen2.5-VL): prompts with images.

The same batched loop as `HFEngine` (native/hf.py), with what the model's forward needs for images::

    prefill each run of equal prompts once (equal tokens and equal pictures, by content)
        input_ids      left-padded, each image's placeholder tokens in place
        pixel_values   the runs' images in order, image_grid_thw their grids: the vision tower runs once per run
        position_ids   [3, rows, width]: each prompt's mrope positions (`MropeIndex`, the model's get_rope_index)
    repeat each run's KV cache for its samples (a GRPO group shares its prompt's image prefill)
    decode: a generated token is text: all three axes at the prompt's largest position + 1, + 1 per step

Weights are known by their checkpoint names (`hybridrl.models.vision.checkpoint_name`), the names the resharder
sends: the language model's as a causal LM's, the tower's as ``visual.*``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridrl.engines.base import GenerationRequest
from hybridrl.engines.native.hf import HFEngine
from hybridrl.models.vision import MropeIndex, checkpoint_name, is_vision_param


class VisionHFEngine(HFEngine):
    """`HFEngine` for a transformers vision-language model: prompts carry images (`GenerationRequest.images`)."""

    takes_images = True

    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        max_batch_size: int = 256,
        tower_trains: bool = False,
    ) -> None:
        """`tower_trains`: the resharder delivers the vision tower with every sync; else it never does, and the
        tower's weights keep their values across every sleep (level 2 drops only what a sync rewrites)."""
        self.mrope = MropeIndex(model)
        super().__init__(model, eos_token_ids, pad_token_id, max_batch_size)
        if not tower_trains:
            self.preserve_weights(n for n in self._unique if is_vision_param(n))

    def _weight_name(self, name: str) -> str:
        return checkpoint_name(name)

    def _prefill_inputs(
        self, prompts: Sequence[GenerationRequest], mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict, torch.Tensor]:
        rows, width = mask.shape
        pos = torch.zeros((3, rows, width), dtype=torch.long)
        next_pos = torch.zeros(rows, dtype=torch.long)
        with_images = [r.images for r in prompts if r.images is not None]
        for i, r in enumerate(prompts):
            grid = r.images.image_grid_thw if r.images is not None else None
            p = self.mrope(r.prompt_ids, grid)
            pos[:, i, width - p.shape[1] :] = p
            next_pos[i] = p.max() + 1
        extra = {}
        if with_images:
            extra["pixel_values"] = torch.cat([x.pixel_values for x in with_images]).to(self.device)
            extra["image_grid_thw"] = torch.cat([x.image_grid_thw for x in with_images]).to(self.device)
        return pos.to(self.device), extra, next_pos.to(self.device)

    def _step_positions(self, next_pos: torch.Tensor) -> torch.Tensor:
        return next_pos[None, :, None].expand(3, -1, 1)
