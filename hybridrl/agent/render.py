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
"""

from __future__ import annotations

from typing import Any

from hybridrl.errors import HybridRLError

SENTINEL = "\u2063hybridrl-assistant-turn\u2063"
_BASE: list[dict[str, Any]] = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": SENTINEL},
]


class TurnRenderer:
    """Token ids of tool-result turns for one tokenizer (its chat template must render role 'tool')."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        probe = "hybridrl-probe-7f3a"
        text = self._render([{"role": "tool", "content": probe}])
        if probe not in text or SENTINEL not in text:
            raise HybridRLError(
                "the tokenizer's chat template does not render tool messages (role 'tool'); rollout=agent needs one. "
                "For the tiny tokenizer, install hybridrl.models.chat_template.install_chat_template; for a real model "
                "use its instruct checkpoint's template"
            )

    def _render(self, tool_messages: list[dict[str, Any]]) -> str:
        return self.tokenizer.apply_chat_template(_BASE + tool_messages, tokenize=False, add_generation_prompt=True)

    def tool_turn_text(self, tool_messages: list[dict[str, Any]], model_stop_text: str = "") -> str:
        """The text after an assistant turn that ends with `model_stop_text` (decoded stop token, or '')."""
        text = self._render(tool_messages)
        delta = text[text.index(SENTINEL) + len(SENTINEL) :]
        if model_stop_text and delta.startswith(model_stop_text):
            delta = delta[len(model_stop_text) :]
        return delta

    def tool_turn_ids(self, tool_messages: list[dict[str, Any]], model_stop_text: str = "") -> list[int]:
        """Token ids of `tool_turn_text` (tokenized alone: these tokens are context, never trained on)."""
        text = self.tool_turn_text(tool_messages, model_stop_text)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
