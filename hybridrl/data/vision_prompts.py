"""Prompt rows with images, rendered and tokenized for a vision-language model, checked at the data check.

Where a row's images go in its prompt, in the forms the field writes them:

- chat messages whose content is a list of parts (``[{"type": "image"}, {"type": "text", "text": "..."}]``, the
  Hugging Face form TRL reads): the image parts, in order;
- a string prompt, or string message contents, with ``<image>`` markers (verl's geo3k form): one per image;
- no marker at all: every image before the text of the first user turn (TRL's default).

The chat template renders each image as its vision block (``<|vision_start|><|image_pad|><|vision_end|>``); the
placeholder is then repeated once per image token (`VisionProcessor.expand`), so the prompt's token ids are what the
model reads and data.max_prompt_tokens counts image tokens too::

    sources = row_images(row, cfg.image_key, base_dir, where); [s.check(where) for s in sources]
    text = render_vision_prompt(row[cfg.prompt_key], len(sources), tokenizer, vision, cfg, where)
    ids = vision.expand(tokenize(text), [vision.tokens_for(s.size) for s in sources], where)
"""

from __future__ import annotations

from typing import Any

from hybridrl.data.config import DataConfig
from hybridrl.errors import HybridRLError

IMAGE_MARKER = "<image>"


def check_vision_prompt(raw: Any, where: str, key: str) -> None:
    """HybridRLError unless `raw` is a string or a non-empty list of {role, content} messages whose content is a
    string or a list of {type: image|text} parts."""
    if isinstance(raw, str):
        return
    if not isinstance(raw, (list, tuple)) or not raw:
        raise HybridRLError(
            f"{where}: column {key!r} (data.prompt_key) is {type(raw).__name__}; it must be a string or a non-empty "
            "list of {role, content} messages"
        )
    for j, m in enumerate(raw):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HybridRLError(f"{where}: message {j} of column {key!r} needs a string 'role'")
        if isinstance(content, str):
            continue
        if not isinstance(content, (list, tuple)) or not all(_is_part(p) for p in content):
            raise HybridRLError(
                f"{where}: message {j} of column {key!r} has content {content!r:.60}; it must be a string or a list "
                "of {'type': 'image'} and {'type': 'text', 'text': ...} parts"
            )


def _is_part(part: Any) -> bool:
    if not isinstance(part, dict):
        return False
    if _is_image(part):
        return True
    return isinstance(part.get("text"), str)


def _is_image(part: dict) -> bool:
    return part.get("type") == "image" or "image" in part or "image_url" in part


def _split_markers(text: str) -> list[dict]:
    """A string with <image> markers as a list of parts."""
    parts: list[dict] = []
    for k, piece in enumerate(text.split(IMAGE_MARKER)):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def vision_messages(raw: Any, n_images: int, where: str) -> list[dict]:
    """The chat messages of a prompt with its `n_images` images placed (module doc); HybridRLError naming `where`
    when the prompt marks another number of images than the row has."""
    messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else [dict(m) for m in raw]
    listed = sum(_is_image(p) for m in messages if isinstance(m["content"], list) for p in m["content"])
    markers = sum(m["content"].count(IMAGE_MARKER) for m in messages if isinstance(m["content"], str))
    if listed and markers:
        raise HybridRLError(f"{where}: the prompt marks images both as image parts and as <image>; use one form")
    if listed or markers:
        marked = listed or markers
        if marked != n_images:
            raise HybridRLError(
                f"{where}: the prompt marks {marked} image(s), the row has {n_images} (data.image_key); "
                "give one image per mark"
            )
        for m in messages:
            if isinstance(m["content"], str) and IMAGE_MARKER in m["content"]:
                m["content"] = _split_markers(m["content"])
        return messages
    if n_images:  # no mark: the images open the first user turn
        first = next((m for m in messages if m["role"] == "user"), None)
        if first is None:
            raise HybridRLError(f"{where}: the row has images but the prompt has no user message to put them in")
        text = first["content"]
        body = [{"type": "text", "text": text}] if isinstance(text, str) else list(text)
        first["content"] = [{"type": "image"} for _ in range(n_images)] + body
    return messages


def render_vision_prompt(raw: Any, n_images: int, tokenizer, vision, cfg: DataConfig, where: str) -> str:
    """The prompt text the model sees: the chat template (the processor's, which renders image parts) over the
    messages with images placed; with data.apply_chat_template=false, the raw string with each <image> (or, without
    markers, the images up front) written as the model's vision block."""
    if not cfg.apply_chat_template:
        if not isinstance(raw, str):
            raise HybridRLError(f"{where}: data.apply_chat_template=false needs string prompts, got chat messages")
        block = tokenizer.decode([vision.vision_start_id, vision.image_token_id, vision.vision_end_id])
        marks = raw.count(IMAGE_MARKER)
        if marks and marks != n_images:
            raise HybridRLError(f"{where}: the prompt has {marks} <image> marker(s), the row {n_images} image(s)")
        return raw.replace(IMAGE_MARKER, block) if marks else block * n_images + raw
    messages = vision_messages(raw, n_images, where)
    if cfg.system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    return tokenizer.apply_chat_template(
        messages, chat_template=vision.chat_template, tokenize=False, add_generation_prompt=True
    )
