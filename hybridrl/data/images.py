"""The images of prompt rows: where each one comes from, checked once at the data check, and what a rollout carries.

A row names its images in the column `data.image_key` (default ``images``), in any of the forms the field writes:
a path (relative to the data file's folder, or absolute), a list of paths, the image structs of Parquet files and
Hugging Face datasets (``{"bytes": ..., "path": ...}``), or raw encoded bytes::

    sources = row_images(row, "images", base_dir, where="data.path=train.jsonl: row 3 (from 0)")
    for s in sources:
        s.check()                       # decoded in full once: a missing or corrupt image fails here, naming it
    ...                                 # each rollout: the model's processor turns them into ImageInputs, once
    inputs = ImageInputs(pixel_values, image_grid_thw, sources)  # read by the engine and by the trainer

`ImageSource.digest` (SHA-1 of the encoded bytes) identifies an image by content: rollouts key shared prefills and
prefix caches by it, so two prompts with equal tokens but different pictures never share a prefill.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridrl.errors import HybridRLError


@dataclass
class ImageSource:
    """One image of a prompt: a file or encoded bytes, named as the row names it."""

    name: str
    """How errors and samples.jsonl name it: the path as the row writes it, or `<bytes, N>` for inline bytes."""
    path: Path | None = None
    """The file (resolved against the data file's folder); None for inline bytes."""
    data: bytes | None = field(default=None, repr=False)
    """The encoded image (PNG, JPEG, ...) when the row holds it inline."""
    digest: str = ""
    """SHA-1 of the encoded bytes, set by `check` (the image's identity for prefix sharing)."""
    size: tuple[int, int] = (0, 0)
    """(width, height) in pixels, set by `check`."""

    def read_bytes(self) -> bytes:
        """The encoded image."""
        if self.data is not None:
            return self.data
        assert self.path is not None
        return self.path.read_bytes()

    def load(self):
        """The decoded image, in RGB (a PIL image)."""
        from PIL import Image

        with Image.open(io.BytesIO(self.read_bytes())) as img:
            return img.convert("RGB")

    def check(self, where: str) -> None:
        """Read and decode the image in full (a truncated file fails only then); sets `digest` and `size`. A missing
        or unreadable image raises HybridRLError naming `where` (the row) and the path."""
        from PIL import Image, UnidentifiedImageError

        label = f"{where}: image {self.name!r}" + (
            f" ({self.path})" if self.path and str(self.path) != self.name else ""
        )
        try:
            raw = self.read_bytes()
        except FileNotFoundError:
            raise HybridRLError(f"{label} not found; paths are relative to the data file's folder") from None
        except OSError as e:
            raise HybridRLError(f"{label} cannot be read ({e.strerror or e})") from None
        try:
            with Image.open(io.BytesIO(raw)) as img:
                img.load()
                self.size = img.size
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise HybridRLError(f"{label} cannot be decoded as an image ({first}); replace or remove the row") from None
        if min(self.size) < 1:
            raise HybridRLError(f"{label} is empty ({self.size[0]}x{self.size[1]} pixels)")
        self.digest = hashlib.sha1(raw).hexdigest()


def row_images(row: dict, key: str, base_dir: Path | None, where: str) -> list[ImageSource]:
    """The images column `key` of `row` as sources (not read yet); HybridRLError naming `where` and `key` when the
    column is missing or holds something that is not an image reference."""
    if key not in row:
        raise HybridRLError(f"{where} has no column {key!r} (data.image_key); columns: {sorted(row)}")
    value = row[key]
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [_source(item, base_dir, f"{where}, column {key!r} item {i}") for i, item in enumerate(items)]


def _source(item: Any, base_dir: Path | None, where: str) -> ImageSource:
    if isinstance(item, dict):  # Parquet / HF datasets image struct: bytes win over the path when both are there
        if item.get("bytes"):
            return _source(item["bytes"], base_dir, where)
        if item.get("path"):
            return _source(item["path"], base_dir, where)
        raise HybridRLError(f"{where}: an image struct needs 'bytes' or 'path', got keys {sorted(item)}")
    if isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
        return ImageSource(name=f"<bytes, {len(data)}>", data=data)
    if isinstance(item, (str, Path)):
        text = str(item)
        if not text:
            raise HybridRLError(f"{where}: an empty image path")
        path = Path(text).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        return ImageSource(name=text, path=path)
    raise HybridRLError(
        f"{where}: {type(item).__name__} is not an image reference (a path, a list of paths, bytes, or "
        "{'bytes': ..., 'path': ...})"
    )


@dataclass
class ImageInputs:
    """One prompt's images as its model reads them, made once per rollout and read by the engine and the trainer."""

    pixel_values: torch.Tensor
    """[patches, channels × temporal patch × patch²] float32: every image's patches, image after image."""
    image_grid_thw: torch.Tensor
    """[images, 3] int64: each image's (temporal, height, width) grid of patches."""
    sources: list[ImageSource]
    """Where the images came from (engines that process images themselves read them again from here)."""

    @property
    def digests(self) -> list[str]:
        """Each image's content digest ("" where it was never read from its bytes)."""
        return [s.digest for s in self.sources]

    @property
    def key(self) -> str:
        """The images' identity by content: equal keys, equal pixels."""
        return ",".join(self.digests)

    @property
    def names(self) -> list[str]:
        """How the row named each image."""
        return [s.name for s in self.sources]

    def __len__(self) -> int:
        return len(self.sources)


def image_key(inputs: ImageInputs | None) -> str:
    """`inputs.key`, or "" for a text-only prompt."""
    return "" if inputs is None else inputs.key
