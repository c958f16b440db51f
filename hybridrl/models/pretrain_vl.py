"""Pre-training of the tiny vision-language model, run once when it is made: digit text, its tower, then captions.

Why it needs one: a randomly initialized vision tower passes almost nothing of a picture on (measured on the tiny
Qwen2-VL: its output varies by about 4% of its energy from one picture to another), and neither RL nor supervised
training of the language model on top of it finds a shape's colour within 300 steps. So the model is first taught to
see, on a task of its own:

    stage 1   the tiny text model's digit text (`hybridrl.models.pretrain`)
    tower     the vision tower alone (with its merger), taught what each picture cell holds: a linear probe on each
              merged output token (one per 28-pixel cell) names the cell's shape (empty, or a colour and a kind),
              and is thrown away after. Without it, whether captions alone teach the tower to see depends on the
              machine: the same 1,000 caption steps saw a shape's colour 0.66 of the time on an AMD EPYC and at
              chance (0.24) on an Intel Xeon, float rounding taking the two runs to different ends
    stage 2   captions, as an instruction-tuned VLM learns them: a user turn with a picture of one to four shapes
              (`hybridrl.data.shapes.draw`, other draws than any task's) and "Describe the picture.", the assistant's
              turn listing the shapes in reading order, ``red square, blue circle<|im_end|>`` (the loss covers that
              turn alone); every other step is digit text again, so stage 1 is not forgotten. After the tower
              stage the tower stays frozen here: trained along, the captions undid what it had learned

What it does not teach: any other question, or an answer of one word. On `data.synthetic.task=colour` ("What colour
is the shape?") the pre-trained model describes the shape (``blue circle``) and is never exactly right: RL has to learn
to answer with the colour alone.

Deterministic for a seed on one machine (one thread, seeded pictures and text); another CPU's float rounding makes
another model.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch

from hybridrl.data.shapes import COLOURS, GRID, KINDS, draw
from hybridrl.models.pretrain import PretrainSpec, pretrain_batches, warmup_cosine_adamw

DESCRIBE = "Describe the picture."
CAPTIONS_FORMAT_VERSION = 2  # 2: captions as a chat turn answering DESCRIBE
#: What the tower's probe names for each cell: 0 empty, then every colour × kind.
CELL_CLASSES = 1 + len(COLOURS) * len(KINDS)


@dataclass(frozen=True)
class CaptionSpec:
    """How the tiny VL model learns to see (part of its cache key)."""

    steps: int = 0
    """Optimizer steps of caption training (every other one on digit text); 0 = none."""
    batch_size: int = 16
    """Pictures (or digit-text rows) per step."""
    lr: float = 2e-3
    """Peak AdamW learning rate (linear warmup over 5% of the steps, cosine to 10% after)."""
    seed: int = 0
    """Seed of the pictures, the text and the order."""
    tower_steps: int = 0
    """Steps training the vision tower alone to name each cell's shape, before the captions; 0 = none."""

    def key(self) -> dict:
        """The spec as plain data, with the version of the text it trains on (for the cache key); without
        `tower_steps` when 0, so the models made before it keep their keys."""
        out = {**asdict(self), "format": CAPTIONS_FORMAT_VERSION}
        if not self.tower_steps:
            del out["tower_steps"]
        return out


def caption_example(rng: random.Random) -> tuple[object, str]:
    """A picture of one to four shapes and its caption (shapes in reading order: row by row, left to right)."""
    shapes = random_shapes(rng)
    return draw(shapes, rng), ", ".join(f"{colour} {kind}" for _, colour, kind in shapes)


def random_shapes(rng: random.Random) -> list[tuple[int, str, str]]:
    """One to four shapes of random colours and kinds in distinct cells, in reading order."""
    cells = sorted(rng.sample(range(GRID * GRID), rng.randint(1, 4)))
    return [(c, rng.choice(list(COLOURS)), rng.choice(KINDS)) for c in cells]


def cell_labels(shapes: list[tuple[int, str, str]]) -> list[int]:
    """What each of the picture's cells holds, in reading order: 0 empty, else 1 + colour index · kinds + kind
    index. The processor orders an image's merged tokens the same way, one per 28-pixel cell."""
    labels = [0] * (GRID * GRID)
    for cell, colour, kind in shapes:
        labels[cell] = 1 + list(COLOURS).index(colour) * len(KINDS) + KINDS.index(kind)
    return labels


def caption_batch(rng: random.Random, n: int, tokenizer, image_processor, merge: int, image_token_id: int) -> dict:
    """Model inputs and labels of `n` captioned pictures in chat form (labels -100 except on the assistant's turn)."""
    pictures, rows = [], []
    for _ in range(n):
        picture, caption = caption_example(rng)
        pictures.append(picture)
        user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": DESCRIBE}]}]
        prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        head = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        rows.append((head, tokenizer(caption, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]))
    out = image_processor(images=pictures, return_tensors="pt")
    grid = out["image_grid_thw"]
    seqs = []
    for g, (head, answer) in zip(grid, rows):
        at = head.index(image_token_id)  # the template's one placeholder, repeated once per image token
        head = head[:at] + [image_token_id] * (int(g.prod()) // merge**2) + head[at + 1 :]
        seqs.append((head, answer))
    width = max(len(h) + len(a) for h, a in seqs)
    ids = torch.full((n, width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((n, width), -100, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, (head, answer) in enumerate(seqs):
        ids[i, : len(head) + len(answer)] = torch.tensor(head + answer)
        labels[i, len(head) : len(head) + len(answer)] = torch.tensor(answer)
        mask[i, : len(head) + len(answer)] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "pixel_values": out["pixel_values"],
        "image_grid_thw": grid,
        "mm_token_type_ids": (ids == image_token_id).int(),
    }


def pretrain_vl(model, tokenizer, image_processor, text: PretrainSpec, captions: CaptionSpec) -> dict[str, list]:
    """Stage 1 (digit text, `text.steps`), the tower stage (`captions.tower_steps`), then stage 2 (captions,
    `captions.steps`) on `model` in place; the losses of each stage."""
    from hybridrl.models.pretrain import pretrain
    from hybridrl.models.vision import image_token_ids, vision_tower

    losses = {"text": pretrain(model, tokenizer, text), "tower": [], "captions": []}
    if captions.steps <= 0 and captions.tower_steps <= 0:
        return losses
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(captions.seed)
            if captions.tower_steps > 0:
                losses["tower"] = _tower(model, image_processor, captions)
            if captions.steps > 0:
                # A tower taught to see stays as it is while the language model learns to read it (LLaVA's
                # instruction stage keeps its encoder frozen too); trained together, the captions undid its seeing.
                frozen = list(vision_tower(model).parameters()) if captions.tower_steps > 0 else []
                for p in frozen:
                    p.requires_grad_(False)
                try:
                    losses["captions"] = _captions(model, tokenizer, image_processor, text, captions, image_token_ids)
                finally:
                    for p in frozen:
                        p.requires_grad_(True)
    finally:
        torch.set_num_threads(threads)
    return losses


def _tower(model, image_processor, spec: CaptionSpec) -> list[float]:
    """Trains the vision tower and its merger to say what each cell holds, through a linear probe on the merged
    tokens (cross-entropy over `CELL_CLASSES`); the probe is dropped, the language model untouched."""
    from hybridrl.models.vision import vision_tower

    tower = vision_tower(model)
    probe = torch.nn.Linear(int(model.config.text_config.hidden_size), CELL_CLASSES)
    params = [*tower.parameters(), *probe.parameters()]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
    rng = random.Random(f"tower/{spec.seed}")
    tower.train()
    losses = []
    for _ in range(spec.tower_steps):
        pictures, labels = [], []
        for _ in range(spec.batch_size):
            shapes = random_shapes(rng)
            pictures.append(draw(shapes, rng))
            labels += cell_labels(shapes)
        out = image_processor(images=pictures, return_tensors="pt")
        merged = tower(out["pixel_values"], grid_thw=out["image_grid_thw"]).pooler_output  # [cells of all, hidden]
        loss = torch.nn.functional.cross_entropy(probe(merged), torch.tensor(labels))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
    tower.eval()
    return losses


def _captions(model, tokenizer, image_processor, text: PretrainSpec, spec: CaptionSpec, image_token_ids) -> list:
    image_token_id = image_token_ids(model.config)["image_token_id"]
    merge = int(model.config.vision_config.spatial_merge_size)
    opt, sched = warmup_cosine_adamw(model, spec.lr, spec.steps)
    rng = random.Random(f"captions/{spec.seed}")
    digits = pretrain_batches(tokenizer, PretrainSpec(batch_size=spec.batch_size, seed=text.seed + 1))
    model.train()
    losses = []
    for step in range(spec.steps):
        if step % 2:  # digit text keeps the language model answering in digits
            x = next(digits)
            loss = model(input_ids=x, labels=x).loss
        else:
            batch = caption_batch(rng, spec.batch_size, tokenizer, image_processor, merge, image_token_id)
            loss = model(**batch).loss
            losses.append(loss.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    return losses
