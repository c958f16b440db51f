"""The tool turn's text: a cached frame where the template writes the content verbatim, a full render elsewhere."""

from __future__ import annotations

import copy

import pytest

from hybridrl.agent.render import SENTINEL, TurnRenderer
from hybridrl.models.chat_template import install_chat_template
from hybridrl.models.tiny import build_tokenizer

CONTENTS = ["6", " padded \n", "<b>&amp;</b>", 'say "hi"\\n', "{{ not jinja }}", "ünïcode ✓", "\n\nlines\n\n"]


@pytest.fixture(scope="module")
def tok():
    t = build_tokenizer()
    install_chat_template(t)
    return t


def full_render(tok, tool_messages, stop_text=""):
    """The tool turn as the chat template writes it, rendered here without the renderer."""
    base = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": SENTINEL},
    ]
    text = tok.apply_chat_template(base + tool_messages, tokenize=False, add_generation_prompt=True)
    delta = text[text.index(SENTINEL) + len(SENTINEL) :]
    return delta[len(stop_text) :] if stop_text and delta.startswith(stop_text) else delta


def turns():
    """Tool turns of one and two messages, with tool names the model chose."""
    for i, content in enumerate(CONTENTS):
        yield [{"role": "tool", "name": "calc", "content": content}]
        yield [
            {"role": "tool", "name": "calc", "content": content},
            {"role": "tool", "name": f"search{i % 2}", "content": CONTENTS[(i + 1) % len(CONTENTS)]},
        ]


def test_framed_turns_equal_the_template(tok):
    renderer = TurnRenderer(tok)
    for stop in ["", "<|im_end|>"]:
        for msgs in turns():
            assert renderer.tool_turn_text(msgs, stop) == full_render(tok, msgs, stop)
            assert (
                renderer.tool_turn_ids(msgs, stop)
                == tok(full_render(tok, msgs, stop), add_special_tokens=False)["input_ids"]
            )
    # The Qwen-style template writes the content verbatim: every form got a frame (one and two messages, 3 names).
    assert len(renderer._frames) == 3 and all(f is not None for f in renderer._frames.values())


def test_empty_and_structured_contents_are_rendered_in_full(tok, monkeypatch):
    renderer = TurnRenderer(tok)
    calls = []
    render = renderer._render
    monkeypatch.setattr(renderer, "_render", lambda msgs: calls.append(msgs) or render(msgs))
    msgs = [{"role": "tool", "name": "calc", "content": ""}]
    assert renderer.tool_turn_text(msgs) == full_render(tok, msgs)
    assert len(calls) == 1 and not renderer._frames


@pytest.mark.parametrize(
    "write",
    [
        "message['content'] | trim",
        "message['content'] | tojson",
        "message['content'] | e",
        "message['content'] + message['content']",
        "message['content'] | replace('\\n', ' ')",
    ],
)
def test_a_template_that_changes_the_content_is_rendered_in_full(tok, write):
    t = copy.deepcopy(tok)
    t.chat_template = t.chat_template.replace(
        "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}",
        "{{- '\\n<tool_response>\\n' }}{{- " + write + " }}{{- '\\n</tool_response>' }}",
    )
    assert t.chat_template != tok.chat_template
    renderer = TurnRenderer(t)
    for msgs in turns():
        assert renderer.tool_turn_text(msgs) == full_render(t, msgs)
    assert renderer._frames and all(f is None for f in renderer._frames.values())


def test_frames_are_bounded(tok, monkeypatch):
    monkeypatch.setattr("hybridrl.agent.render.MAX_FRAMES", 4)
    renderer = TurnRenderer(tok)
    for i in range(10):
        msgs = [{"role": "tool", "name": f"tool{i}", "content": "x"}]
        assert renderer.tool_turn_text(msgs) == full_render(tok, msgs)
    assert list(renderer._frames) == [((("name", f"tool{i}"), ("role", "tool")),) for i in range(6, 10)]


def test_the_fast_backend_is_used_only_where_it_encodes_as_the_tokenizer_does(tok):
    assert TurnRenderer(tok)._backend is tok.backend_tokenizer  # the tiny tokenizer's call wraps it unchanged

    class Marking:
        """The tiny tokenizer, but its own call (what the loop must match) adds an id the backend does not."""

        backend_tokenizer = tok.backend_tokenizer
        all_special_ids = tok.all_special_ids

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": tok(text, add_special_tokens=add_special_tokens)["input_ids"] + [7]}

        def __getattr__(self, name):
            return getattr(tok, name)

    marking = Marking()
    renderer = TurnRenderer(marking)
    assert renderer._backend is None
    msgs = [{"role": "tool", "name": "calc", "content": "6"}]
    assert renderer.tool_turn_ids(msgs) == marking(full_render(tok, msgs))["input_ids"]
