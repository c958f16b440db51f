"""The built-in visual task: small pictures of coloured shapes, and a question with a one-word answer.

`data=synthetic_vl` (`data.synthetic.task=colour|count|lower|shape`) draws the pictures once, deterministically from
the seed, into a folder under $HYBRIDRL_CACHE (PNG files and train/val JSONL files naming them by relative path), and
reads that folder exactly as it reads a user's JSONL file with images (`data.image_key=images`), so samples.jsonl
names each sample's picture by its file::

    {"prompt": "<image>What colour is the shape?", "images": ["images/train-00017.png"], "answer": "blue",
     "task": "colour"}

colour: one shape; the answer is its colour (red, green, blue or yellow). count: one to four shapes of several colours;
the question names a colour present in the picture and the answer is how many shapes have it (a digit). lower: two
shapes of two colours in different rows; the answer is the colour of the lower one (a caption, which lists shapes in
reading order, names the upper one first). shape: one shape of any colour; the answer is its kind (square or circle;
a caption names the colour first). A picture is
a 4×4 grid of 28-pixel cells (112 pixels a side: one image token of a Qwen2-VL model per merged cell), each shape
inside one cell. The `shapes` reward (hybridrl/rewards/shapes.py) scores an answer: whether its first word is the
answer, and its format (that word alone, ended by EOS).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

VISION_TASKS = ("colour", "count", "lower", "shape")
KINDS = ("square", "circle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}
CELL, GRID = 28, 4
SIDE = CELL * GRID
SHAPES_FORMAT_VERSION = 2

COLOUR_QUESTION = "What colour is the shape?"
COUNT_QUESTION = "How many {colour} shapes?"
LOWER_QUESTION = "What colour is the lower shape?"
SHAPE_QUESTION = "Which shape is it?"


def draw(shapes: list[tuple[int, str, str]], rng: random.Random):
    """A picture of `shapes` (cell index 0-15, colour name, "square" | "circle"), each jittered inside its cell."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIDE, SIDE), (245, 245, 245))
    pen = ImageDraw.Draw(img)
    for cell, colour, kind in shapes:
        size = rng.randint(14, 22)
        x0 = (cell % GRID) * CELL + rng.randint(0, CELL - size)
        y0 = (cell // GRID) * CELL + rng.randint(0, CELL - size)
        box = (x0, y0, x0 + size - 1, y0 + size - 1)
        (pen.rectangle if kind == "square" else pen.ellipse)(box, fill=COLOURS[colour])
    return img


def make_row(task: str, rng: random.Random) -> tuple[dict, list[tuple[int, str, str]]]:
    """One row (prompt with its <image> mark, answer) and the shapes its picture shows."""
    names = list(COLOURS)
    if task == "colour":
        colour = rng.choice(names)
        shapes = [(rng.randrange(GRID * GRID), colour, rng.choice(KINDS))]
        return {"prompt": "<image>" + COLOUR_QUESTION, "answer": colour}, shapes
    if task == "count":
        cells = rng.sample(range(GRID * GRID), rng.randint(1, 4))
        shapes = [(c, rng.choice(names), rng.choice(KINDS)) for c in cells]
        asked = rng.choice(sorted({s[1] for s in shapes}))
        answer = sum(s[1] == asked for s in shapes)
        return {"prompt": "<image>" + COUNT_QUESTION.format(colour=asked), "answer": str(answer)}, shapes
    if task == "lower":
        top, bottom = rng.sample(names, 2)
        upper_row = rng.randrange(GRID - 1)
        lower_row = rng.randrange(upper_row + 1, GRID)
        cells = [upper_row * GRID + rng.randrange(GRID), lower_row * GRID + rng.randrange(GRID)]
        shapes = [(cells[0], top, rng.choice(KINDS)), (cells[1], bottom, rng.choice(KINDS))]
        return {"prompt": "<image>" + LOWER_QUESTION, "answer": bottom}, shapes
    if task == "shape":
        kind = rng.choice(KINDS)
        shapes = [(rng.randrange(GRID * GRID), rng.choice(names), kind)]
        return {"prompt": "<image>" + SHAPE_QUESTION, "answer": kind}, shapes
    raise ValueError(f"unknown visual task {task!r}; expected one of {VISION_TASKS}")


def write_split(folder: Path, split: str, task: str, n: int, seed: int) -> None:
    """`n` rows of `task` into folder/<split>.jsonl, their pictures into folder/images/."""
    rng = random.Random(f"{task}/{split}/{seed}")
    lines = []
    for i in range(n):
        row, shapes = make_row(task, rng)
        name = f"images/{split}-{i:05d}.png"
        draw(shapes, rng).save(folder / name, optimize=True)
        lines.append(json.dumps({**row, "images": [name], "task": task}))
    (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")


def ensure_shapes_data(task: str, num_train: int, num_val: int, seed: int, cache_dir: str | None = None) -> Path:
    """The folder of the visual task's data (train.jsonl, val.jsonl, images/), made on first use and then reused;
    written under a temporary name and renamed when complete."""
    from hybridrl.models.tiny import default_cache_dir

    if task not in VISION_TASKS:
        raise ValueError(f"unknown visual task {task!r}; expected one of {VISION_TASKS}")
    spec = {"task": task, "train": num_train, "val": num_val, "seed": seed, "format": SHAPES_FORMAT_VERSION}
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / f"shapes-{task}-{key}"
    if (target / "val.jsonl").exists():
        return target
    tmp = root / f".tmp-{target.name}-{os.getpid()}"
    (tmp / "images").mkdir(parents=True, exist_ok=True)
    write_split(tmp, "train", task, num_train, seed)
    write_split(tmp, "val", task, num_val, seed + 1)
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target
