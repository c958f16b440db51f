"""Prompts with images (`data.image_key`): read and decoded at the data check, their placeholders expanded to the
image's tokens; a missing, corrupt or truncated image fails there, naming the row and the path."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from hybridrl.data.config import DataConfig
from hybridrl.data.prompts import load_prompts
from hybridrl.errors import HybridRLError
from hybridrl.models.image_processor import VisionProcessor
from hybridrl.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def vision(tiny_vl_path):
    return VisionProcessor(tiny_vl_path)


@pytest.fixture(scope="module")
def vl_tokenizer(tiny_vl_path):
    return load_tokenizer(tiny_vl_path)


def png(width: int, height: int, colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


def write_jsonl(folder, rows) -> str:
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load(path, tokenizer, vision, **kw):
    return load_prompts(DataConfig(name="jsonl", path=path, **kw), tokenizer, vision=vision)[0]


def test_images_are_read_relative_to_the_data_file_and_expanded(tmp_path, vl_tokenizer, vision):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png(112, 112))
    (tmp_path / "pics" / "b.png").write_bytes(png(56, 84, (0, 0, 255)))
    rows = [
        {"prompt": "<image>What colour?", "images": "pics/a.png", "answer": "red"},
        {"prompt": "<image> and <image>: same colour?", "images": ["pics/a.png", "pics/b.png"], "answer": "no"},
    ]
    one, two = load(write_jsonl(tmp_path, rows), vl_tokenizer, vision)
    pad = vision.image_token_id
    # Qwen2-VL: 14-pixel patches merged 2×2, so one token per 28×28 pixels: 112² -> 16, 56×84 -> 2×3 = 6.
    assert one.token_ids.count(pad) == 16
    assert two.token_ids.count(pad) == 16 + 6
    assert [s.name for s in two.images] == ["pics/a.png", "pics/b.png"]
    assert two.images[0].digest == one.images[0].digest != two.images[1].digest
    inputs = vision.process(two.images)
    assert inputs.image_grid_thw.tolist() == [[1, 8, 8], [1, 6, 4]]  # (t, h, w) in 14-pixel patches
    assert inputs.pixel_values.shape[0] == 64 + 24


@pytest.mark.parametrize(
    "content, why",
    [(None, "not found"), (b"not an image", "cannot be decoded"), ("truncated", "cannot be decoded")],
)
def test_a_missing_or_corrupt_image_fails_at_the_data_check_naming_row_and_path(
    tmp_path, vl_tokenizer, vision, content, why
):
    (tmp_path / "ok.png").write_bytes(png(56, 56))
    if content == "truncated":
        content = png(112, 112, (1, 2, 3))[:60]
    if content is not None:
        (tmp_path / "bad.png").write_bytes(content)
    rows = [
        {"prompt": "<image>What colour?", "images": "ok.png"},
        {"prompt": "<image>What colour?", "images": ["ok.png", "bad.png"]},
    ]
    with pytest.raises(HybridRLError, match=r"row 1 \(from 0\).*'bad\.png'") as err:
        load(write_jsonl(tmp_path, rows), vl_tokenizer, vision)
    assert why in str(err.value)


def test_placeholders_and_images_must_agree(tmp_path, vl_tokenizer, vision):
    (tmp_path / "a.png").write_bytes(png(56, 56))
    rows = [{"prompt": "<image> and <image>?", "images": ["a.png"]}]
    with pytest.raises(HybridRLError, match=r"row 0 \(from 0\): the prompt marks 2 image\(s\), the row has 1"):
        load(write_jsonl(tmp_path, rows), vl_tokenizer, vision)


def test_a_file_without_the_image_column_names_data_image_key(tmp_path, vl_tokenizer, vision):
    rows = [{"prompt": "What colour?", "pictures": ["a.png"]}]
    with pytest.raises(HybridRLError, match="data.image_key"):
        load(write_jsonl(tmp_path, rows), vl_tokenizer, vision)


def test_parquet_image_structs_with_bytes(tmp_path, vl_tokenizer, vision):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    data = png(84, 84)
    rows = [{"prompt": "<image>What colour?", "images": [{"bytes": data, "path": None}], "answer": "red"}]
    path = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(path)
    (prompt,) = load(str(path), vl_tokenizer, vision)
    assert prompt.token_ids.count(vision.image_token_id) == 9  # 84 pixels: 3×3 tokens of 28
    assert prompt.images[0].name == f"<bytes, {len(data)}>"
    corrupt = [{"prompt": "<image>?", "images": [{"bytes": b"\x89PNG broken", "path": None}]}]
    pd.DataFrame(rows + corrupt).to_parquet(path)
    with pytest.raises(HybridRLError, match=r"row 1 \(from 0\).*<bytes, 11>.*cannot be decoded"):
        load(str(path), vl_tokenizer, vision)
