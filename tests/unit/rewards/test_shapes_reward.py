"""The built-in visual task (data=synthetic_vl): each answer read back from the picture's pixels, and the `shapes`
reward on hand-scored answers."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from hybridrl.data.shapes import CELL, COLOURS, GRID, ensure_shapes_data
from hybridrl.rewards.base import RewardInput
from hybridrl.rewards.shapes import shapes_reward


def rows_with(img: Image.Image, rgb: tuple[int, int, int]) -> list[int]:
    """The grid row of each cell holding at least one pixel of exactly `rgb` (each shape lies inside one cell, drawn
    unblended)."""
    px = img.load()
    return [
        cy
        for cx in range(GRID)
        for cy in range(GRID)
        if any(px[cx * CELL + x, cy * CELL + y] == rgb for x in range(CELL) for y in range(CELL))
    ]


def box_fill(img: Image.Image, rgb: tuple[int, int, int]) -> float:
    """The share of the bounding box of `rgb`'s pixels that they cover: 1 for a square, about pi/4 for a circle."""
    px = img.load()
    hits = [(x, y) for x in range(img.size[0]) for y in range(img.size[1]) if px[x, y] == rgb]
    xs, ys = [x for x, _ in hits], [y for _, y in hits]
    return len(hits) / ((max(xs) - min(xs) + 1) * (max(ys) - min(ys) + 1))


def cells_with(img: Image.Image, rgb: tuple[int, int, int]) -> int:
    """Grid cells holding at least one pixel of exactly `rgb`."""
    return len(rows_with(img, rgb))


@pytest.mark.parametrize("task", ["colour", "count", "lower", "shape"])
def test_answers_are_what_the_pictures_show(tmp_path, task):
    folder = ensure_shapes_data(task, num_train=12, num_val=4, seed=3, cache_dir=str(tmp_path))
    assert ensure_shapes_data(task, num_train=12, num_val=4, seed=3, cache_dir=str(tmp_path)) == folder  # cached
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and len({r["images"][0] for r in rows}) == 12
    for row in rows:
        img = Image.open(folder / row["images"][0]).convert("RGB")
        assert img.size == (GRID * CELL, GRID * CELL)
        if task == "colour":
            present = [name for name, rgb in COLOURS.items() if cells_with(img, rgb)]
            assert present == [row["answer"]], row
        elif task == "shape":
            (colour,) = [name for name, rgb in COLOURS.items() if cells_with(img, rgb)]
            assert row["answer"] == ("square" if box_fill(img, COLOURS[colour]) > 0.95 else "circle"), row
        elif task == "lower":
            rows_of = {name: rows_with(img, rgb) for name, rgb in COLOURS.items()}
            shown = {name: r for name, r in rows_of.items() if r}
            assert len(shown) == 2 and all(len(r) == 1 for r in shown.values()), row  # two shapes, two colours
            upper, lower = sorted(shown, key=lambda name: shown[name])
            assert shown[upper] < shown[lower] and row["answer"] == lower, row
        else:
            asked = next(name for name in COLOURS if f"How many {name} shapes?" in row["prompt"])
            assert str(cells_with(img, COLOURS[asked])) == row["answer"], row


def score(response, answer="blue", task="colour", finish="stop"):
    return shapes_reward([RewardInput("", response, {"answer": answer, "task": task}, finish_reason=finish)])[0]


@pytest.mark.parametrize(
    "response, task, answer, finish, expected",
    [
        ("blue", "colour", "blue", "stop", (1.0, 1.0, 1.0, 1.0)),  # 0.75 + 0.25
        ("Blue.", "colour", "blue", "stop", (1.0, 1.0, 1.0, 1.0)),
        ("blue circle", "colour", "blue", "stop", (0.75, 0.0, 1.0, 0.0)),  # right, not alone
        ("red", "colour", "blue", "stop", (0.25, 1.0, 0.0, 0.0)),  # a possible answer, wrong
        ("blu", "colour", "blue", "stop", (0.0, 0.0, 0.0, 0.0)),  # not a colour
        ("blue", "colour", "blue", "length", (0.875, 0.5, 1.0, 0.0)),  # cut off: half the format
        ("green", "lower", "green", "stop", (1.0, 1.0, 1.0, 1.0)),
        ("yellow square", "lower", "green", "length", (0.0, 0.0, 0.0, 0.0)),  # the upper shape's caption
        ("circle", "shape", "circle", "stop", (1.0, 1.0, 1.0, 1.0)),
        ("green sq", "shape", "square", "length", (0.0, 0.0, 0.0, 0.0)),  # a caption: the colour first
        ("square", "shape", "circle", "stop", (0.25, 1.0, 0.0, 0.0)),
        ("3", "count", "3", "stop", (1.0, 1.0, 1.0, 1.0)),
        ("three", "count", "3", "stop", (0.0, 0.0, 0.0, 0.0)),
        ("", "count", "3", "stop", (0.0, 0.0, 0.0, 0.0)),
    ],
)
def test_shapes_reward(response, task, answer, finish, expected):
    out = score(response, answer, task, finish)
    assert (out["score"], out["format"], out["correct"], out["exact"]) == pytest.approx(expected)
