"""The tiny VL model's tower stage: its labels name what each picture cell holds in the order the processor gives the
merged tokens, and the captions that follow leave the tower it trained as it was."""

from __future__ import annotations

import random

import torch

from hybridrl.data.shapes import CELL, GRID, draw
from hybridrl.models.pretrain import PretrainSpec
from hybridrl.models.pretrain_vl import CELL_CLASSES, CaptionSpec, cell_labels, pretrain_vl


def test_cell_labels_name_each_cells_colour_and_kind():
    labels = cell_labels([(0, "red", "square"), (6, "blue", "circle"), (15, "yellow", "circle")])
    # 0 empty; then (colour index · 2 + kind index) + 1 with colours red, green, blue, yellow and kinds square, circle
    assert labels == [1, 0, 0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0, 0, 8]
    assert CELL_CLASSES == 9


def test_the_processors_merged_tokens_follow_the_cells_in_reading_order(tiny_vl_path):
    """The probe's label k must describe merged token k: a picture with one shape in cell k has non-background
    pixels only in the four 14-pixel patches that token k merges."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(tiny_vl_path)
    background = processor(images=[draw([], random.Random(0))], return_tensors="pt")["pixel_values"]
    for cell in (0, 3, 6, GRID * GRID - 1):
        picture = draw([(cell, "red", "square")], random.Random(cell))
        assert picture.size == (CELL * GRID, CELL * GRID)
        pixels = processor(images=[picture], return_tensors="pt")["pixel_values"]
        changed = ((pixels - background).abs().amax(dim=1) > 0.1).nonzero().flatten()
        assert set((changed // 4).tolist()) == {cell}, (cell, changed)


def test_captions_after_the_tower_stage_leave_the_tower_as_it_learned(tiny_vl_path):
    """The tower stage trains the tower (and nothing of the language model); the captions then train the language
    model and keep the tower frozen: the tower ends as the tower stage alone leaves it (both runs are seeded)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from hybridrl.models.vision import vision_tower

    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_path)
    processor = AutoImageProcessor.from_pretrained(tiny_vl_path)

    def trained(caption_steps: int):
        model = AutoModelForImageTextToText.from_pretrained(tiny_vl_path, dtype=torch.float32)
        spec = CaptionSpec(steps=caption_steps, batch_size=2, tower_steps=2)
        losses = pretrain_vl(model, tokenizer, processor, PretrainSpec(steps=0, batch_size=2, seq_len=16), spec)
        return model, losses

    start = dict(AutoModelForImageTextToText.from_pretrained(tiny_vl_path, dtype=torch.float32).named_parameters())
    tower_only, losses = trained(0)
    assert len(losses["tower"]) == 2 and not losses["captions"]
    tower_names = {f"model.visual.{n}" for n, _ in vision_tower(tower_only).named_parameters()}
    assert tower_names <= set(start)
    moved = {n for n, p in tower_only.named_parameters() if not torch.equal(p, start[n])}
    assert moved and moved <= tower_names  # only the tower learned

    both, losses = trained(2)
    assert len(losses["captions"]) == 1  # every other step is digit text
    after_tower = dict(tower_only.named_parameters())
    moved = {n for n, p in both.named_parameters() if not torch.equal(p, after_tower[n])}
    assert moved and not moved & tower_names  # the language model learned, the tower did not
    assert all(p.requires_grad for p in both.parameters())  # frozen for the captions only
