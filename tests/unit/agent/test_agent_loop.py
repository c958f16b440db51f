"""The agent loop against scripted engines: token sequence, masks, turn boundaries, seeds, limits, tool failures,
concurrency, and the fallback adapter's per-turn batching. Expected token sequences are written out by hand."""

from __future__ import annotations

import asyncio
import time

import pytest
from tokenizers import pre_tokenizers
from transformers import Qwen2Tokenizer

from hybridrl.agent import AgentConfig, AgentLoop, Tool, ToolError, TurnBatchingAdapter, agent_metrics, turn_seed
from hybridrl.agent.batch import trajectories_to_batch
from hybridrl.agent.testing import ScriptedAsyncEngine, ScriptedEngine, scripted_logprob
from hybridrl.agent.tools.calculator import Calculator
from hybridrl.data.prompts import Prompt
from hybridrl.engines.base import SamplingParams
from hybridrl.models.chat_template import install_chat_template
from hybridrl.models.tiny import SPECIAL_TOKENS, build_tokenizer

ENGINES = [ScriptedAsyncEngine, ScriptedEngine]  # continuous (async) and the fallback (per-turn batches)


@pytest.fixture(scope="module")
def tok():
    t = build_tokenizer()
    install_chat_template(t)
    return t


@pytest.fixture(scope="module")
def merge_tok():
    """The tiny byte-level tokenizer plus one merge, "a" "b" -> "ab": re-encoding text changes ids."""
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    vocab["ab"] = len(vocab)
    t = Qwen2Tokenizer(
        vocab=vocab,
        merges=[("a", "b")],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    install_chat_template(t)
    return t


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def call_ids(tok, expr: str, name: str = "calculator") -> list[int]:
    return ids(tok, f'<tool_call>\n{{"name": "{name}", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>')


def prompt_ids(tok, text: str) -> list[int]:
    return ids(tok, f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def tool_turn(tok, *results: str) -> list[int]:
    """The template tokens after a model turn that ended with <|im_end|>, written out by hand (Qwen2.5 layout)."""
    body = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
    return ids(tok, f"\n<|im_start|>user{body}<|im_end|>\n<|im_start|>assistant\n")


class Sleepy(Tool):
    name = "sleepy"
    parameters = {"type": "object", "properties": {}}

    def __init__(self, seconds: float = 0.2) -> None:
        self.seconds = seconds

    def call(self, arguments):
        time.sleep(self.seconds)
        return "rested"


class Boom(Tool):
    name = "boom"

    def call(self, arguments):
        raise ValueError("kaput")


class Refuse(Tool):
    name = "refuse"

    def call(self, arguments):
        raise ToolError("not today")


class Garbage(Tool):
    name = "garbage"

    def call(self, arguments):
        return object()


def run(loop, engine, prompts, n=1, seed=11, max_new_tokens=200, offset=0):
    params = SamplingParams(n=n, max_new_tokens=max_new_tokens, seed=seed, prompt_offset=offset)
    return loop.generate_sync(engine, prompts, params)


@pytest.mark.parametrize("Engine", ENGINES)
def test_two_turns_tokens_masks_logprobs(tok, Engine):
    eos = tok.eos_token_id
    first = call_ids(tok, "12345*6789") + [eos]
    answer = ids(tok, "83810205") + [eos]
    engine = Engine({(0, 0, 0): first, (0, 0, 1): answer}, [eos])
    loop = AgentLoop(AgentConfig(), tok)
    prompt = prompt_ids(tok, "Compute 12345*6789")
    (t,) = run(loop, engine, [prompt])
    tool = tool_turn(tok, "83810205")  # 12345 * 6789 = 83810205
    assert t.prompt_ids == prompt
    assert t.response_ids == first + tool + answer
    assert t.response_mask == [1] * len(first) + [0] * len(tool) + [1] * len(answer)
    want_lp = (
        [scripted_logprob(0, 0, 0, k) for k in range(len(first))]
        + [0.0] * len(tool)
        + [scripted_logprob(0, 0, 1, k) for k in range(len(answer))]
    )
    assert t.logprobs == want_lp
    assert (t.turns, t.tool_calls, t.tool_errors, t.truncated, t.end_reason, t.finish_reason) == (
        2,
        1,
        0,
        False,
        "done",
        "stop",
    )
    assert t.model_tokens == len(first) + len(answer)
    # The second turn was asked to continue exactly the context built so far.
    (req1, _, turn1) = engine.requests[-1]
    assert turn1 == 1 and req1.prompt_ids == prompt + first + tool
    # The whole sequence reads as the conversation rendered by the chat template (turn boundaries in place).
    conv = [{"role": "user", "content": "Compute 12345*6789"}] + t.messages
    full = tok.apply_chat_template(conv, tokenize=False)
    assert tok.decode(prompt + t.response_ids) + "\n" == full
    assert t.messages[0]["tool_calls"][0]["function"] == {
        "name": "calculator",
        "arguments": {"expression": "12345*6789"},
    }
    assert t.messages[1] == {"role": "tool", "name": "calculator", "content": "83810205"}


@pytest.mark.parametrize("Engine", ENGINES)
def test_model_tokens_are_never_reencoded(merge_tok, Engine):
    tok = merge_tok
    a, b, ab, eos = tok.convert_tokens_to_ids(["a", "b", "ab", tok.eos_token])
    first = [a, b] + call_ids(tok, "1+1") + [eos]  # the model spelled "ab" as two tokens
    answer = [a, b, a, b, eos]
    engine = Engine({(0, 0, 0): first, (0, 0, 1): answer}, [eos])
    (t,) = run(AgentLoop(AgentConfig(), tok), engine, [prompt_ids(tok, "x")])
    tool = tool_turn(tok, "2")
    assert t.response_ids == first + tool + answer
    assert ab not in [x for x, m in zip(t.response_ids, t.response_mask) if m]
    # Re-encoding the text would have merged them: the test would catch a decode/encode round trip.
    text = tok.decode(t.response_ids)
    assert ids(tok, text) != t.response_ids and ab in ids(tok, text)
    assert engine.requests[-1][0].prompt_ids[-len(tool) - len(first) :] == first + tool


@pytest.mark.parametrize("Engine", ENGINES)
def test_turn_seeds_and_request_keys(tok, Engine):
    eos = tok.eos_token_id
    script = {(p, s, 0): call_ids(tok, "2*3") + [eos] for p in (5, 6) for s in (0, 1)}
    engine = Engine(script, [eos], default=ids(tok, "6") + [eos])
    run(AgentLoop(AgentConfig(), tok), engine, [prompt_ids(tok, "a"), prompt_ids(tok, "bb")], n=2, seed=7, offset=5)
    got = sorted((r.prompt_index, r.sample_index, turn, p.seed, p.n) for r, p, turn in engine.requests)
    # turn_seed(7, 1) = (7 + 2654435761) mod (2**31 - 1) = 506952121, by hand
    want = sorted((pi, si, turn, 7 if turn == 0 else 506952121, 1) for pi in (5, 6) for si in (0, 1) for turn in (0, 1))
    assert got == want
    assert turn_seed(7, 0) == 7 and turn_seed(7, 2) == (7 + 2 * 2654435761) % (2**31 - 1) and turn_seed(None, 3) is None


@pytest.mark.parametrize("Engine", ENGINES)
def test_tool_failures_become_counted_messages(tok, Engine):
    eos = tok.eos_token_id
    turns = [
        ids(tok, '<tool_call>\n{"name": "boom", "arguments": {}}\n</tool_call>'),
        ids(tok, '<tool_call>\n{"name": "sleepy", "arguments": {}}\n</tool_call>'),  # times out
        ids(tok, '<tool_call>\n{"name": "calculator", "arguments": {"expression": 1+}}\n</tool_call>'),  # bad JSON
        ids(tok, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'),
        ids(tok, '<tool_call>\n{"name": "refuse", "arguments": {}}\n</tool_call>'),
        ids(tok, '<tool_call>\n{"name": "garbage", "arguments": {}}\n</tool_call>'),
        ids(tok, '<tool_call>\n{"name": "calculator", "arguments": {"expr": "1"}}\n</tool_call>'),  # bad argument
        ids(tok, "done"),
    ]
    engine = Engine({(0, 0, k): x + [eos] for k, x in enumerate(turns)}, [eos])
    cfg = AgentConfig(max_turns=10, max_total_tokens=4000, tool_timeouts={"sleepy": 0.05})
    tools = {t.name: t for t in (Boom(), Sleepy(1.0), Calculator(), Refuse(), Garbage())}
    (t,) = run(AgentLoop(cfg, tok, tools), engine, [prompt_ids(tok, "go")])
    assert (t.turns, t.tool_calls, t.tool_errors, t.end_reason, t.truncated) == (8, 7, 7, "done", False)
    errors = [m["content"] for m in t.messages if m["role"] == "tool"]
    assert all(e.startswith("Error: ") for e in errors)
    for e, words in zip(
        errors,
        [
            "ValueError: kaput",
            "timed out after 0.05 s",
            "malformed tool call: invalid JSON",
            "unknown tool 'nope'",
            "not today",
            "returned object",
            "needs argument(s) ['expression']",
        ],
    ):
        assert words in e, (words, e)
    assert agent_metrics([t])["agent/tool_errors"] == 7.0


@pytest.mark.parametrize("Engine", ENGINES)
def test_on_tool_error_stop_ends_the_trajectory(tok, Engine):
    eos = tok.eos_token_id
    bad = ids(tok, '<tool_call>\n{"name": "boom", "arguments": {}}\n</tool_call>') + [eos]
    engine = Engine({(0, 0, 0): bad}, [eos])
    (t,) = run(AgentLoop(AgentConfig(on_tool_error="stop"), tok, {"boom": Boom()}), engine, [prompt_ids(tok, "go")])
    assert (t.turns, t.tool_errors, t.end_reason, t.truncated, t.finish_reason) == (1, 1, "tool_error", False, "stop")
    assert t.response_ids == bad and t.messages[-1]["content"].startswith("Error: ")


@pytest.mark.parametrize("Engine", ENGINES)
def test_max_turns(tok, Engine):
    eos = tok.eos_token_id
    again = call_ids(tok, "1+1") + [eos]
    engine = Engine(lambda p, s, turn: again, [eos])
    (t,) = run(AgentLoop(AgentConfig(max_turns=3, max_total_tokens=4000), tok), engine, [prompt_ids(tok, "go")])
    tool = tool_turn(tok, "2")
    assert t.response_ids == again + tool + again + tool + again  # the last turn's call is not run
    assert (t.turns, t.tool_calls, t.tool_errors, t.truncated, t.end_reason, t.finish_reason) == (
        3,
        3,
        0,
        True,
        "max_turns",
        "length",
    )


@pytest.mark.parametrize("Engine", ENGINES)
def test_max_total_tokens_caps_the_last_turn(tok, Engine):
    eos = tok.eos_token_id
    first = call_ids(tok, "1+1") + [eos]
    long_answer = ids(tok, "2" * 50) + [eos]
    prompt = prompt_ids(tok, "go")
    budget = len(prompt) + len(first) + len(tool_turn(tok, "2")) + 10
    engine = Engine({(0, 0, 0): first, (0, 0, 1): long_answer}, [eos])
    (t,) = run(AgentLoop(AgentConfig(max_total_tokens=budget), tok), engine, [prompt])
    assert len(prompt) + len(t.response_ids) == budget
    assert t.response_ids[-10:] == long_answer[:10] and t.response_mask[-10:] == [1] * 10
    assert (t.truncated, t.end_reason, t.finish_reason, t.turns) == (True, "max_total_tokens", "length", 2)
    assert engine.requests[-1][1].max_new_tokens == 10


@pytest.mark.parametrize("Engine", ENGINES)
def test_tool_turn_that_does_not_fit_is_not_appended(tok, Engine):
    eos = tok.eos_token_id
    first = call_ids(tok, "1+1") + [eos]
    prompt = prompt_ids(tok, "go")
    budget = len(prompt) + len(first) + len(tool_turn(tok, "2"))  # the tool turn fits, but leaves no room to answer
    engine = Engine({(0, 0, 0): first}, [eos])
    (t,) = run(AgentLoop(AgentConfig(max_total_tokens=budget), tok), engine, [prompt])
    assert t.response_ids == first and (t.truncated, t.end_reason, t.tool_calls) == (True, "max_total_tokens", 1)


@pytest.mark.parametrize("Engine", ENGINES)
def test_turn_cap_and_truncation_mask_policy(tok, Engine):
    eos = tok.eos_token_id
    rambling = ids(tok, "x" * 30)
    engine = Engine({(0, 0, 0): rambling}, [eos])
    (t,) = run(AgentLoop(AgentConfig(on_truncation="mask"), tok), engine, [prompt_ids(tok, "go")], max_new_tokens=8)
    assert t.response_ids == rambling[:8] and t.response_mask == [0] * 8 and t.model_tokens == 8
    assert (t.truncated, t.end_reason, t.finish_reason) == (True, "max_new_tokens", "length")


@pytest.mark.parametrize("Engine", ENGINES)
def test_prompt_over_budget_gives_an_empty_truncated_trajectory(tok, Engine):
    prompt = prompt_ids(tok, "y" * 40)
    engine = Engine({}, [tok.eos_token_id])
    (t,) = run(AgentLoop(AgentConfig(max_total_tokens=len(prompt)), tok), engine, [prompt])
    assert t.response_ids == [] and t.truncated and t.turns == 0 and engine.requests == []


def test_fallback_and_async_give_the_same_trajectories(tok):
    """Prompts of different lengths hit the budget at different caps: the fallback batches them under one cap and
    cuts each back; the result must equal per-request generation."""
    eos = tok.eos_token_id
    prompts = [prompt_ids(tok, "q" * k) for k in (1, 7, 15, 30)]
    script = {(p, s, 0): call_ids(tok, f"{p}*{s}+1") + [eos] for p in range(4) for s in range(3)}
    default = ids(tok, "answer " * 8) + [eos]
    need = len(prompts[0]) + len(script[0, 0, 0]) + len(tool_turn(tok, "1")) + len(default)
    cfg = AgentConfig(max_total_tokens=need + 5)  # the shortest prompts finish, the longest are cut
    outs = []
    for Engine in ENGINES:
        outs.append(run(AgentLoop(cfg, tok), Engine(script, [eos], default=default), prompts, n=3))
    assert [vars(t) | {"tool_seconds": 0} for t in outs[0]] == [vars(t) | {"tool_seconds": 0} for t in outs[1]]
    assert {t.end_reason for t in outs[0]} == {"done", "max_total_tokens"}
    assert [(t.prompt_index, t.sample_index) for t in outs[0]] == [(p, s) for p in range(4) for s in range(3)]


@pytest.mark.parametrize("Engine", ENGINES)
def test_concurrent_tool_calls_do_not_serialize(tok, Engine):
    eos = tok.eos_token_id
    sleepy = ids(tok, '<tool_call>\n{"name": "sleepy", "arguments": {}}\n</tool_call>') + [eos]
    engine = Engine(lambda p, s, turn: sleepy if turn == 0 else ids(tok, "ok") + [eos], [eos])
    loop = AgentLoop(AgentConfig(), tok, {"sleepy": Sleepy(0.2)})
    t0 = time.perf_counter()
    trajs = run(loop, engine, [prompt_ids(tok, "go")], n=16)
    elapsed = time.perf_counter() - t0
    assert all(t.turns == 2 and t.tool_calls == 1 and t.tool_errors == 0 for t in trajs)
    assert sum(t.tool_seconds for t in trajs) >= 16 * 0.2 * 0.95  # each really slept 0.2 s
    assert elapsed < 16 * 0.2 / 2, f"16 trajectories x 0.2 s tool took {elapsed:.2f} s: tool calls serialized"
    if Engine is ScriptedEngine:
        assert engine.batch_sizes == [16, 16]  # one batch per turn: the barrier


def test_fallback_barrier_waits_for_the_slowest_tool_of_the_turn(tok):
    eos = tok.eos_token_id

    class Varied(Tool):
        name = "varied"
        parameters = {"type": "object", "properties": {"s": {"type": "number"}}}

        def call(self, arguments):
            time.sleep(arguments["s"])
            return "ok"

    def script(p, s, turn):
        if turn == 0 and s < 3:
            return ids(tok, f'<tool_call>{{"name": "varied", "arguments": {{"s": {0.05 * (s + 1)}}}}}</tool_call>') + [
                eos
            ]
        return ids(tok, "end") + [eos]

    sync, fast = ScriptedEngine(script, [eos]), ScriptedAsyncEngine(script, [eos])
    loop = AgentLoop(AgentConfig(), tok, {"varied": Varied()})
    run(loop, sync, [prompt_ids(tok, "go")], n=4)
    run(loop, fast, [prompt_ids(tok, "go")], n=4)
    assert sync.batch_sizes == [4, 3]  # sample 3 finished in turn 0; the other three answered in one batch
    # With per-request generation, the quickest tool's trajectory asked first.
    order = [r.sample_index for r, _, turn in fast.requests if turn == 1]
    assert order == [0, 1, 2]


def test_fallback_adapter_propagates_engine_errors(tok):
    class Broken:
        def generate_requests(self, requests, params):
            raise RuntimeError("engine died")

    loop = AgentLoop(AgentConfig(), tok)
    with pytest.raises(RuntimeError, match="engine died"):
        run(loop, Broken(), [prompt_ids(tok, "a"), prompt_ids(tok, "b")], n=2)
    with pytest.raises(TypeError, match="generate_requests"):
        run(loop, object(), [prompt_ids(tok, "a")])


def test_max_concurrent_trajectories_lanes(tok):
    eos = tok.eos_token_id
    engine = ScriptedEngine(lambda p, s, turn: ids(tok, "ok") + [eos], [eos])
    adapter = TurnBatchingAdapter(engine)
    trajs = run(AgentLoop(AgentConfig(max_concurrent_trajectories=3), tok), adapter, [prompt_ids(tok, "go")], n=7)
    assert len(trajs) == 7 and engine.batch_sizes == [3, 3, 1] and adapter.live == 0


def test_metrics_and_batch(tok):
    eos = tok.eos_token_id
    first = call_ids(tok, "2*3") + [eos]
    engine = ScriptedAsyncEngine(
        {(0, 0, 0): first, (1, 0, 0): ids(tok, "42") + [eos]}, [eos], default=ids(tok, "6") + [eos]
    )
    prompts = [prompt_ids(tok, "a"), prompt_ids(tok, "bbb")]
    trajs = run(AgentLoop(AgentConfig(), tok), engine, prompts)
    m = agent_metrics(trajs)
    assert m["agent/turns_mean"] == 1.5 and m["agent/tool_calls_mean"] == 0.5 and m["agent/tool_errors"] == 0.0
    assert m["agent/truncated_frac"] == 0.0 and m["agent/tool_error_rate"] == 0.0
    rows = [Prompt(p, f"text{i}", {"answer": str(i)}) for i, p in enumerate(prompts)]
    batch = trajectories_to_batch(rows, trajs)
    tool = tool_turn(tok, "6")
    n0, n1 = len(first) + len(tool) + 2, 3
    assert batch["responses"].shape == (2, n0)
    assert batch["response_attention_mask"].sum(-1).tolist() == [n0, n1]
    assert batch["response_mask"].sum(-1).tolist() == [len(first) + 2, n1]
    assert batch["responses"][1, n1:].tolist() == [0] * (n0 - n1)
    assert batch.meta["sample"][1] == {"answer": "1"} and batch.meta["turns"] == [2, 1]
    assert batch["engine_logprobs"][0, len(first) : len(first) + len(tool)].abs().sum() == 0


def test_metrics_hand_computed():
    from hybridrl.agent import Trajectory

    a = Trajectory(0, 0, [1], turns=3, tool_calls=2, tool_errors=1, tool_seconds=0.5, truncated=True, model_tokens=10)
    b = Trajectory(0, 1, [1], turns=1, tool_calls=0, tool_errors=0, tool_seconds=0.0, model_tokens=4)
    m = agent_metrics([a, b])
    assert m == {
        "agent/turns_mean": 2.0,
        "agent/tool_calls_mean": 1.0,
        "agent/tool_errors": 1.0,
        "agent/tool_error_rate": 0.5,
        "agent/tool_seconds": 0.5,
        "agent/truncated_frac": 0.5,
        "agent/model_tokens_mean": 7.0,
    }
    assert agent_metrics([]) == {}


def test_loop_needs_a_template_with_tool_messages():
    from hybridrl.errors import HybridRLError

    plain = build_tokenizer()
    plain.chat_template = (  # a template that knows only user and assistant turns
        "{% for m in messages %}{% if m['role'] in ('user', 'assistant') %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    with pytest.raises(HybridRLError, match="does not render tool messages"):
        AgentLoop(AgentConfig(), plain)


def test_runs_inside_an_existing_event_loop(tok):
    eos = tok.eos_token_id
    engine = ScriptedAsyncEngine({}, [eos], default=ids(tok, "hi") + [eos])
    loop = AgentLoop(AgentConfig(), tok)

    async def main():
        return await loop.generate(engine, [prompt_ids(tok, "x")], SamplingParams(n=2, seed=1))

    trajs = asyncio.run(main())
    assert [t.response_ids for t in trajs] == [ids(tok, "hi") + [eos]] * 2


@pytest.mark.slow
def test_cpu_agent_recipe_learns_to_call_the_tool(tmp_path):
    """`python -m hybridrl recipe=cpu_agent` runs end to end, logs the agent/* metrics every step, and its header's
    claim holds: the tiny model learns to open tool calls (reward/tried over the last 20% of steps ≥ first + 0.5)."""
    import json

    from hybridrl.tracking.plot import first_last_means
    from tests.integration.test_e2e import run_app

    run_dir = tmp_path / "run"
    r = run_app(["recipe=cpu_agent", "logger.progress_bar=false", f"hydra.run.dir={run_dir}"], tmp_path, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 50
    for key in ("agent/turns_mean", "agent/tool_calls_mean", "agent/tool_error_rate", "agent/truncated_frac"):
        assert all(key in row for row in rows), key
    first, last = first_last_means([row["reward/tried"] for row in rows])
    assert last >= first + 0.5, (first, last)
