"""Tool-call parsers: Hermes/Qwen, Llama-3.1 JSON and Mistral, well-formed and malformed."""

from __future__ import annotations

import pytest

from hybridrl.agent.parsers import ToolCall, get_parser, parse_hermes, parse_llama3_json, parse_mistral
from hybridrl.errors import ConfigError


def test_hermes_calls_and_content():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>\n'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    )
    p = parse_hermes(text)
    assert p.content == "Let me compute."
    assert p.calls == [ToolCall("calculator", {"expression": "2*3"}), ToolCall("python", {"code": "print(1)"})]
    assert p.errors == []


def test_hermes_plain_answer_has_no_calls():
    p = parse_hermes("The answer is 42.")
    assert (p.content, p.calls, p.errors) == ("The answer is 42.", [], [])


@pytest.mark.parametrize(
    "text, words",
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": 1+}}</tool_call>', "invalid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'no "name" string'),
        ('<tool_call>{"name": "c", "arguments": [1, 2]}</tool_call>', "must be a JSON object, got list"),
        ('<tool_call>["c"]</tool_call>', "must be a JSON object, got list"),
        ('<tool_call>{"name": "c", "arguments": "not json"}</tool_call>', "a string that is not JSON"),
        ('Sure. <tool_call>{"name": "c", "arguments": {}}', "not closed by </tool_call>"),
    ],
)
def test_hermes_malformed(text, words):
    p = parse_hermes(text)
    assert p.calls == [] and len(p.errors) == 1 and words in p.errors[0]
    assert "expected <tool_call>" in p.errors[0]


def test_hermes_mixed_good_and_bad():
    p = parse_hermes('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>')
    assert p.calls == [ToolCall("a", {})] and len(p.errors) == 1


def test_llama3_json():
    p = parse_llama3_json('{"name": "calculator", "parameters": {"expression": "1+1"}}')
    assert p.calls == [ToolCall("calculator", {"expression": "1+1"})] and p.errors == []
    p = parse_llama3_json('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert p.calls == [ToolCall("a", {}), ToolCall("b", {"x": 1})]
    p = parse_llama3_json("It is 2.")
    assert (p.content, p.calls, p.errors) == ("It is 2.", [], [])
    p = parse_llama3_json('{"name": "a", "parameters": {')
    assert p.calls == [] and "invalid JSON" in p.errors[0]
    p = parse_llama3_json("<|python_tag|>print(1)")
    assert p.calls == [] and "no JSON object after <|python_tag|>" in p.errors[0]


def test_mistral():
    p = parse_mistral('Checking. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]')
    assert p.content == "Checking." and p.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    p = parse_mistral('[TOOL_CALLS]{"name": "a", "arguments": {}}')
    assert p.calls == [ToolCall("a", {})]
    p = parse_mistral("[TOOL_CALLS][{bad")
    assert p.calls == [] and "invalid JSON" in p.errors[0]
    assert parse_mistral("no calls").calls == []


def test_get_parser():
    assert get_parser("hermes") is parse_hermes
    with pytest.raises(ConfigError, match="agent.format='xml'"):
        get_parser("xml")
    # Your own format by import path, as agent.tools takes your own tools.
    assert get_parser("hybridrl.agent.parsers:parse_mistral") is parse_mistral
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        get_parser("no_such_module:parse")
    with pytest.raises(ConfigError, match="has no .nothing."):
        get_parser("hybridrl.agent.parsers:nothing")
