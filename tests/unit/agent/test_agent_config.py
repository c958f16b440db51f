"""Agent config (errors name the key; composes through OmegaConf), the tool chat template on the tiny tokenizer,
the rollout YAML group, and the calc task with its rewards."""

from __future__ import annotations

from importlib.resources import files

import pytest
from omegaconf import OmegaConf

from hybridrl.agent.config import AgentConfig
from hybridrl.agent.loop import AgentLoop
from hybridrl.agent.tasks import calc_exact, calc_shaped, make_calc_rows
from hybridrl.errors import ConfigError
from hybridrl.models.chat_template import TOOL_TOKENS, install_chat_template, renders_tool_messages
from hybridrl.models.tiny import build_tokenizer
from hybridrl.rewards import RewardInput, resolve_reward
from hybridrl.rollout.config import RolloutConfig

# The tiny tokenizer's template before it rendered tools (Qwen's chat markup): plain conversations must render the
# same under the tool template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"max_turns": 0}, "agent.max_turns"),
        ({"max_total_tokens": 1}, "agent.max_total_tokens"),
        ({"tools": ["calc ulator"]}, "agent.tools"),
        ({"tools": ["calculator", "calculator"]}, "agent.tools"),
        ({"tool_options": {"python": {}}}, "agent.tool_options.python"),
        ({"tools": ["a.b:Search"], "tool_options": {"a.b:Search": {}}}, "agent.tool_options.a.b:Search"),
        ({"tools": ["a.b:Search", "c:Search"]}, "agent.tools: two entries share a class name"),
        ({"format": "xml"}, "agent.format"),
        ({"tool_timeout_s": 0}, "agent.tool_timeout_s"),
        ({"tool_timeouts": {"python": -1}}, "agent.tool_timeouts.python"),
        ({"max_tool_calls_per_turn": 0}, "agent.max_tool_calls_per_turn"),
        ({"max_tool_output_chars": 3}, "agent.max_tool_output_chars"),
        ({"max_concurrent_trajectories": -1}, "agent.max_concurrent_trajectories"),
        ({"max_concurrent_tools": 0}, "agent.max_concurrent_tools"),
        ({"on_tool_error": "ignore"}, "agent.on_tool_error"),
        ({"on_truncation": "drop"}, "agent.on_truncation"),
    ],
)
def test_agent_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        AgentConfig(**kwargs)


def test_prompt_tool_schemas():
    from hybridrl.agent import prompt_tool_schemas

    schemas = prompt_tool_schemas(AgentConfig(tools=["calculator", "python"]))
    assert [s["function"]["name"] for s in schemas] == ["calculator", "python"]
    assert schemas[0]["function"]["parameters"]["required"] == ["expression"]
    assert prompt_tool_schemas(AgentConfig(tools_in_prompt=False)) is None


def test_rollout_config():
    assert RolloutConfig().name == "single"
    with pytest.raises(ConfigError, match=r"rollout\.name"):
        RolloutConfig(name="multi")


def test_agent_config_composes_through_omegaconf():
    base = OmegaConf.structured(AgentConfig)
    over = OmegaConf.from_dotlist(
        [
            "tools=[calculator,python,my_pkg.tools:Search]",
            "tool_options.python.memory_mb=512",
            "tool_options.Search.k=1",
            "tool_timeouts.python=30",
            "max_turns=6",
        ]
    )
    cfg = OmegaConf.to_object(OmegaConf.merge(base, over))
    assert isinstance(cfg, AgentConfig) and cfg.max_turns == 6
    assert cfg.tool_options == {"python": {"memory_mb": 512}, "Search": {"k": 1}}
    assert cfg.timeout_for("python") == 30.0 and cfg.timeout_for("calculator") == 10.0
    with pytest.raises(Exception):
        OmegaConf.merge(base, OmegaConf.from_dotlist(["max_turn=3"]))  # unknown key
    with pytest.raises(Exception, match="max_turns"):
        OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.from_dotlist(["max_turns=0"])))


def test_rollout_yaml_group_ships_with_the_package():
    conf = files("hybridrl.conf").joinpath("rollout")
    for name in ("single", "agent"):
        cfg = OmegaConf.merge(OmegaConf.structured(RolloutConfig), OmegaConf.load(str(conf.joinpath(f"{name}.yaml"))))
        assert OmegaConf.to_object(cfg).name == name


# -- chat template ----------------------------------------------------------------------------------------------
PLAIN_CONVERSATIONS = [
    [{"role": "user", "content": "copy: 123"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ],
]


@pytest.mark.parametrize("conv", PLAIN_CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_tool_template_renders_plain_conversations_like_the_tiny_template(conv, gen):
    plain, tooled = build_tokenizer(), build_tokenizer()
    plain.chat_template = CHAT_TEMPLATE  # the tiny tokenizer's plain template (build_tokenizer may install ours)
    install_chat_template(tooled)
    want = plain.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
    assert tooled.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen) == want


def test_tool_template_renders_qwen25_layout():
    tok = build_tokenizer()
    install_chat_template(tok)
    size = len(tok)
    assert install_chat_template(tok) == 0 and len(tok) == size  # idempotent
    tools = [
        {
            "type": "function",
            "function": {"name": "calculator", "description": "Evaluate.", "parameters": {"type": "object"}},
        }
    ]
    conv = [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "2*3?"},
        {
            "role": "assistant",
            "content": "Calling.",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}},
                {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1"}'}},
            ],
        },
        {"role": "tool", "content": "6"},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": "6"},
    ]
    want = (
        "<|im_start|>system\nBe exact.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "calculator", "description": "Evaluate.", '
        '"parameters": {"type": "object"}}}\n'
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n2*3?<|im_end|>\n"
        '<|im_start|>assistant\nCalling.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n1\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n6<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=True) == want
    for tag in TOOL_TOKENS:  # one token each, kept by decode(skip_special_tokens=True)
        (i,) = tok(tag, add_special_tokens=False)["input_ids"]
        assert tok.decode([i], skip_special_tokens=True) == tag
    assert renders_tool_messages(tok)


def test_install_adds_the_four_tags_once():
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    present = [t for t in TOOL_TOKENS if t in tok.get_vocab()]  # all four once build_tokenizer installs them
    before = len(tok)
    assert install_chat_template(tok) == 4 - len(present) and len(tok) == before + 4 - len(present)


def test_template_survives_save_and_load(tmp_path):
    from transformers import AutoTokenizer

    tok = build_tokenizer()
    install_chat_template(tok)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    conv = [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]
    assert again.apply_chat_template(conv, tokenize=False) == tok.apply_chat_template(conv, tokenize=False)
    assert (
        again("<tool_call>", add_special_tokens=False)["input_ids"]
        == tok("<tool_call>", add_special_tokens=False)["input_ids"]
    )
    AgentLoop(AgentConfig(), again)  # the loop accepts the reloaded tokenizer


# -- the calc task ----------------------------------------------------------------------------------------------
def test_calc_rows():
    rows = make_calc_rows(200, 4, 5, seed=3)
    assert rows == make_calc_rows(200, 4, 5, seed=3)
    assert len({r["digits"] for r in rows}) == 200
    for r in rows:
        a, b = r["digits"].split("*")
        assert 4 <= len(a) <= 5 and 4 <= len(b) <= 5 and not a.startswith("0")
        assert r["answer"] == str(int(a) * int(b)) and r["prompt"] == f"Compute {a}*{b}"
    val = make_calc_rows(20, 4, 5, seed=4, exclude={r["digits"] for r in rows})
    assert not {r["digits"] for r in val} & {r["digits"] for r in rows}
    with pytest.raises(ConfigError, match="only 81 distinct products"):
        make_calc_rows(100, 1, 1, seed=0)


def _item(messages=None, response=""):
    sample = {"answer": "440040051"}
    if messages is not None:
        sample["messages"] = messages
    return RewardInput(prompt="Compute 48213*9127", response=response, sample=sample)


def test_calc_rewards_read_the_final_assistant_message():
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calculator"}}],
    }
    solved = [call, {"role": "tool", "content": "440040051"}, {"role": "assistant", "content": "It is 440,040,051."}]
    echoed_only = [call, {"role": "tool", "content": "440040051"}, {"role": "assistant", "content": "done"}]
    failed_tool = [call, {"role": "tool", "content": "Error: boom"}, {"role": "assistant", "content": "440040051"}]
    guessed = [{"role": "assistant", "content": "440040050"}]
    assert calc_exact([_item(m) for m in (solved, echoed_only, failed_tool, guessed)]) == [
        {"score": 1.0, "exact": 1.0, "tool_ok": 1.0, "tried": 1.0, "answered": 1.0},
        {"score": 0.0, "exact": 0.0, "tool_ok": 1.0, "tried": 1.0, "answered": 0.0},
        {"score": 1.0, "exact": 1.0, "tool_ok": 0.0, "tried": 1.0, "answered": 1.0},
        {"score": 0.0, "exact": 0.0, "tool_ok": 0.0, "tried": 0.0, "answered": 1.0},
    ]
    # exact + 0.2 * tool_ok + 0.1 * tried, by hand
    assert [
        r["score"] for r in calc_shaped([_item(m) for m in (solved, echoed_only, failed_tool, guessed)])
    ] == pytest.approx([1.3, 0.3, 1.1, 0.0])
    assert resolve_reward("calc_exact") is not None and resolve_reward("calc_shaped") is not None


def test_calc_reward_falls_back_to_the_decoded_response():
    text = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48213*9127"}}\n</tool_call>\n'
        "user\n<tool_response>\n440040051\n</tool_response>\nassistant\n440040051"
    )
    assert calc_exact([_item(response=text)])[0] == {
        "score": 1.0,
        "exact": 1.0,
        "tool_ok": 1.0,
        "tried": 1.0,
        "answered": 1.0,
    }
    lazy = text.rsplit("assistant\n", 1)[0] + "assistant\n<tool_call>{}"  # the tool's number alone does not count
    assert calc_exact([_item(response=lazy)])[0]["exact"] == 0.0
