"""A Qwen2.5-style chat template with tool calling, for tokenizers that have none (the tiny tokenizer).

Roles system / user / assistant / tool. With `tools=[...]` the tools' JSON schemas go into the system turn with
the instructions Qwen2.5 uses; an assistant message's `tool_calls` render as ``<tool_call>{json}</tool_call>``
blocks; consecutive tool results render inside one user turn, each wrapped in ``<tool_response>...</tool_response>``.
Without tools and tool messages it renders exactly what the tiny tokenizer's plain template renders (no default
system prompt), so single-turn prompts do not change.

`install_chat_template(tokenizer)` sets the template and adds the four tags as (non-special) added tokens, so a
byte-level tokenizer spends one token per tag and `decode(..., skip_special_tokens=True)` keeps them.
"""

from __future__ import annotations

TOOL_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

TOOLS_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_CALL_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

# Jinja; whitespace control (`{%-`) keeps the template's own line breaks out of the output.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '" + TOOLS_INSTRUCTIONS.replace("\n", "\\n") + "' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '" + TOOLS_CALL_FORMAT.replace("\n", "\\n") + "<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def install_chat_template(tokenizer, add_tokens: bool = True) -> int:
    """Give `tokenizer` the tool-calling template (and, with `add_tokens`, the tags as added tokens).

    Returns how many tokens were added: a model built for this tokenizer needs `vocab_size >= len(tokenizer)`,
    so call this before the model's config is made (the tiny model does, in `build_tokenizer`).
    """
    from tokenizers import AddedToken

    added = 0
    if add_tokens:
        new = [t for t in TOOL_TOKENS if t not in tokenizer.get_vocab()]
        added = tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in new])
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return added


def renders_tool_messages(tokenizer) -> bool:
    """True when the tokenizer's chat template shows a tool message's content (what the agent loop needs)."""
    probe = "hybridrl-probe-7f3a"
    try:
        text = tokenizer.apply_chat_template(
            [
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"},
                {"role": "tool", "content": probe},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception:
        return False
    return probe in text
