"""Tool-call parsers: the text of one assistant turn → its content, its tool calls, and what was malformed.

Formats (`agent.format`):

- `hermes` (Qwen2.5, Qwen3, Hermes): one or more ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.
- `llama3_json` (Llama 3.1/3.2 JSON tool calling): the turn is a JSON object ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``; several calls may be joined by ``;``.
- `mistral`: content, then ``[TOOL_CALLS]`` and a JSON list ``[{"name": ..., "arguments": {...}}, ...]``.

Parsing never raises: a call that cannot be read (bad JSON, no name, arguments not an object, an unclosed tag) is
reported in `ParsedTurn.errors`, and the loop turns each error into a message to the model (counted as a tool error).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridrl.errors import ConfigError
from hybridrl.import_path import load_import_path


@dataclass
class ToolCall:
    """One call the model asked for."""

    name: str
    """The tool's name as the model wrote it."""
    arguments: dict[str, Any]
    """Keyword arguments (a JSON object)."""

    def as_message_part(self) -> dict[str, Any]:
        """The call in the Hugging Face chat format (`message["tool_calls"][i]`)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    """What one assistant turn said and asked for."""

    content: str
    """The text without the tool-call markup."""
    calls: list[ToolCall] = field(default_factory=list)
    """Well-formed calls, in order."""
    errors: list[str] = field(default_factory=list)
    """One message per malformed call (what was wrong and the expected form)."""


def _call_from_obj(obj: Any, args_key: str) -> ToolCall | str:
    """A ToolCall from a decoded JSON object, or the reason it is not one."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return 'the tool call has no "name" string'
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"the arguments of {name!r} are a string that is not JSON ({e.msg})"
    if not isinstance(args, dict):
        return f"the arguments of {name!r} must be a JSON object, got {type(args).__name__}"
    return ToolCall(name, args)


def _loads(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at character {e.pos})"


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
HERMES_EXPECTED = 'expected <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'


def parse_hermes(text: str) -> ParsedTurn:
    """`<tool_call>{json}</tool_call>` blocks; text outside the blocks is the content."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for block in _HERMES_BLOCK.findall(text):
        obj, err = _loads(block.strip())
        call = _call_from_obj(obj, "arguments") if err is None else err
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(f"malformed tool call: {call}; {HERMES_EXPECTED}")
    rest = _HERMES_BLOCK.sub("", text)
    if "<tool_call>" in rest:
        errors.append(f"malformed tool call: <tool_call> is not closed by </tool_call>; {HERMES_EXPECTED}")
        rest = rest[: rest.index("<tool_call>")]
    return ParsedTurn(rest.strip(), calls, errors)


LLAMA_EXPECTED = 'expected {"name": "<tool>", "parameters": {...}}'


def parse_llama3_json(text: str) -> ParsedTurn:
    """A turn that is a JSON call (after an optional `<|python_tag|>`); any other turn is plain content."""
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    if tagged:
        body = body[len("<|python_tag|>") :].strip()
    if not body.startswith("{"):
        if tagged:
            return ParsedTurn("", [], [f"malformed tool call: no JSON object after <|python_tag|>; {LLAMA_EXPECTED}"])
        return ParsedTurn(text.strip())
    calls: list[ToolCall] = []
    errors: list[str] = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            errors.append(f"malformed tool call: invalid JSON ({e.msg} at character {e.pos}); {LLAMA_EXPECTED}")
            break
        call = _call_from_obj(obj, "parameters")
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(f"malformed tool call: {call}; {LLAMA_EXPECTED}")
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return ParsedTurn("", calls, errors)


MISTRAL_EXPECTED = 'expected [TOOL_CALLS][{"name": "<tool>", "arguments": {...}}]'


def parse_mistral(text: str) -> ParsedTurn:
    """Content, then `[TOOL_CALLS]` and a JSON list of calls (or one object)."""
    if "[TOOL_CALLS]" not in text:
        return ParsedTurn(text.strip())
    content, _, payload = text.partition("[TOOL_CALLS]")
    obj, err = _loads(payload.strip())
    if err is not None:
        return ParsedTurn(content.strip(), [], [f"malformed tool call: {err}; {MISTRAL_EXPECTED}"])
    calls: list[ToolCall] = []
    errors: list[str] = []
    for item in obj if isinstance(obj, list) else [obj]:
        call = _call_from_obj(item, "arguments")
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(f"malformed tool call: {call}; {MISTRAL_EXPECTED}")
    return ParsedTurn(content.strip(), calls, errors)


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}


def get_parser(fmt: str) -> Callable[[str], ParsedTurn]:
    """The parser of `agent.format`: a built-in format's, or the function an import path `pkg.module:function`
    names (ConfigError naming `agent.format` when it cannot be loaded)."""
    if fmt in PARSERS:
        return PARSERS[fmt]
    if ":" not in fmt:
        raise ConfigError(f"agent.format={fmt!r} is not a known tool-call format; known: {sorted(PARSERS)}")
    parser = load_import_path(fmt, "agent.format")
    if not callable(parser):
        raise ConfigError(f"agent.format={fmt!r} names {type(parser).__name__}, not a function")
    return parser
