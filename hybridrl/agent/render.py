"""The tokens between two assistant turns — tool results and template markup — rendered by the chat template.

The model's own tokens are never re-rendered: only the text *after* an assistant turn is. It is found by
rendering a fixed conversation whose last assistant message is a sentinel, with the tool messages appended and the
generation prompt on, and keeping what follows the sentinel::

    <|im_start|>assistant\\n SENTINEL <|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n6\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
    └──────────────────────────── the tool turn ─────────────────────────────────────┘

When the model ended its turn with a stop token the template also writes (Qwen's `<|im_end|>`), that leading piece
is dropped, since the model's token is already in the context; when the turn ended otherwise (a stop id of the
user's choosing) the template's end-of-turn markup stays, so the context reads as a well-formed conversation.

Rendering the template in full is the largest part of a turn's host work (about 60 of 210 µs on a 2-core CPU), paid
in the event loop's thread that a GPU engine's driver thread shares the interpreter with, so tool turns of the same form
(the same roles and tool names) reuse a *frame*: the turn's text with each message's content cut out. A frame is
made by rendering the form with probe contents and is used only if the template writes a second set of probes
verbatim (leading and trailing whitespace, markup, quotes and backslashes, which catch a `trim`, an escape or
`tojson`); a template that changes a tool's content is always rendered in full, and so is an empty content. A
template that picks its markup by what the content says would not be caught by the probes (the Qwen templates
insert it verbatim).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from hybridrl.errors import HybridRLError

SENTINEL = "\u2063hybridrl-assistant-turn\u2063"
_BASE: list[dict[str, Any]] = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": SENTINEL},
]
#: Forms of tool turn whose frames are kept (tool names come from the model's output, so the set is unbounded).
MAX_FRAMES = 256


def _slot(i: int) -> str:
    return f"\u2063hybridrl-content-{i}\u2063"


def _check(i: int) -> str:
    return f" \n<b>&amp;'\"{{{i}}}\\ \u2063check-{i}\n "


class TurnRenderer:
    """Token ids of tool-result turns for one tokenizer (its chat template must render role 'tool')."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._frames: OrderedDict[tuple, tuple[str, ...] | None] = OrderedDict()
        probe = "hybridrl-probe-7f3a"
        text = self._apply([{"role": "tool", "content": probe}])
        if probe not in text or SENTINEL not in text:
            raise HybridRLError(
                "the tokenizer's chat template does not render tool messages (role 'tool'); rollout=agent needs one. "
                "For the tiny tokenizer, install hybridrl.models.chat_template.install_chat_template; for a real model "
                "use its instruct checkpoint's template"
            )
        self._backend = self._fast_backend()

    def _apply(self, tool_messages: list[dict[str, Any]]) -> str:
        return self.tokenizer.apply_chat_template(_BASE + tool_messages, tokenize=False, add_generation_prompt=True)

    def _render(self, tool_messages: list[dict[str, Any]]) -> str:
        """The template's text after the sentinel assistant turn."""
        text = self._apply(tool_messages)
        return text[text.index(SENTINEL) + len(SENTINEL) :]

    def tool_turn_text(self, tool_messages: list[dict[str, Any]], model_stop_text: str = "") -> str:
        """The text after an assistant turn that ends with `model_stop_text` (decoded stop token, or '')."""
        frame = self._frame(tool_messages)
        if frame is None:
            delta = self._render(tool_messages)
        else:
            parts = [frame[0]]
            for msg, tail in zip(tool_messages, frame[1:]):
                parts += (msg["content"], tail)
            delta = "".join(parts)
        if model_stop_text and delta.startswith(model_stop_text):
            delta = delta[len(model_stop_text) :]
        return delta

    def tool_turn_ids(self, tool_messages: list[dict[str, Any]], model_stop_text: str = "") -> list[int]:
        """Token ids of `tool_turn_text` (tokenized alone: these tokens are context, never trained on)."""
        return self._encode(self.tool_turn_text(tool_messages, model_stop_text))

    def _encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _fast_backend(self):
        """The `tokenizers` object behind a fast tokenizer, where it encodes the probes exactly as the tokenizer does:
        about half the time of the tokenizer's own call, which wraps it; else None."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        probes = [self._render([{"role": "tool", "name": "n", "content": c}]) for c in (_check(0), "x", " ✓\n\n")]
        for text in probes + [self.tokenizer.decode([t]) for t in self.tokenizer.all_special_ids]:
            if (
                backend.encode(text, add_special_tokens=False).ids
                != self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ):
                return None
        return backend

    # -- frames -------------------------------------------------------------------------------------------------
    def _frame(self, tool_messages: list[dict[str, Any]]) -> tuple[str, ...] | None:
        """The text around each message's content for this form of tool turn, or None: render it in full."""
        try:
            form = tuple(tuple(sorted((k, v) for k, v in m.items() if k != "content")) for m in tool_messages)
            hash(form)
        except TypeError:  # a field that is not a plain value (a list, a dict): no key to keep a frame by
            return None
        if any(not isinstance(m.get("content"), str) or not m["content"] for m in tool_messages):
            return None
        if form in self._frames:
            self._frames.move_to_end(form)
            return self._frames[form]
        frame = self._make_frame(tool_messages)
        self._frames[form] = frame
        if len(self._frames) > MAX_FRAMES:
            self._frames.popitem(last=False)
        return frame

    def _make_frame(self, tool_messages: list[dict[str, Any]]) -> tuple[str, ...] | None:
        def filled(contents: list[str]) -> list[dict[str, Any]]:
            return [{**m, "content": c} for m, c in zip(tool_messages, contents)]

        n = len(tool_messages)
        text = self._render(filled([_slot(i) for i in range(n)]))
        pieces, start = [], 0
        for i in range(n):
            at = text.find(_slot(i), start)
            if at < 0:
                return None
            pieces.append(text[start:at])
            start = at + len(_slot(i))
        pieces.append(text[start:])
        checks = [_check(i) for i in range(n)]
        expected = pieces[0] + "".join(c + p for c, p in zip(checks, pieces[1:]))
        return tuple(pieces) if self._render(filled(checks)) == expected else None
