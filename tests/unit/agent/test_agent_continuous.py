"""A run's agent loop drives the native fused engine through its continuous batching, not one batch per turn: a
trajectory whose tool answers at once gets its next turn generated while another trajectory's tool is still running.

Through the worker's generate phase, as a run builds it (`HybridWorker`, `rollout=agent`, the tiny model), with the
loop in the worker's process and in a child process of its own (`agent.process`). The tool is a gate, not a clock:
its first call holds until another trajectory has come back to it a second time (so that trajectory's next turn was
generated meanwhile), or until a deadline, and says which in its answer. One batch per turn cannot release it: the
fast trajectory's next turn waits for the held one's, so the held call runs out its deadline (the transformers path
shows it, as a control).
"""

from __future__ import annotations

import threading

import pytest

from hybridrl.agent.parsers import ParsedTurn, ToolCall
from hybridrl.agent.tools import Tool
from hybridrl.engines.base import SamplingParams
from tests.conftest import chat_prompt

GATE = f"{__name__}:Gate"


class Gate(Tool):
    """Call 1 holds until call 3 comes, at most `deadline_s` seconds; every other call answers at once. With two
    trajectories calling it once per turn, calls 1 and 2 are their first turns' calls and call 3 can only be the
    second call of the trajectory that was not held."""

    name = "gate"

    def __init__(self, deadline_s: float = 60.0) -> None:
        self.deadline_s = deadline_s
        self.calls = 0
        self.lock = threading.Lock()
        self.third_call = threading.Event()

    def call(self, arguments):
        with self.lock:
            self.calls += 1
            n = self.calls
        if n == 1:  # whether call 1 saw call 3 before its deadline
            return RELEASED if self.third_call.wait(self.deadline_s) else HELD
        if n == 3:
            self.third_call.set()
        return "ok"


RELEASED, HELD = "released", "held to its deadline"


def gate_answer(trajectories) -> str:
    """The gate's first call's answer (every other call answers "ok"), read from the trajectories' transcripts."""
    (answer,) = [m["content"] for t in trajectories for m in t.messages if m["role"] == "tool" and m["content"] != "ok"]
    return answer


def every_turn_calls_the_gate(text: str) -> ParsedTurn:
    """`agent.format` here: a random-weight model writes no tool calls, so every turn is read as a call to the gate."""
    return ParsedTurn(text, [ToolCall("gate", {})])


def agent_worker(tiny_path, impl: str, deadline_s: float, process: str = "worker"):
    from hybridrl.agent.config import AgentConfig
    from hybridrl.config import RunConfig
    from hybridrl.engines.config import EngineConfig, NativeOptions
    from hybridrl.models.config import ModelConfig
    from hybridrl.models.loading import load_tokenizer
    from hybridrl.rollout.config import RolloutConfig
    from hybridrl.workers.worker import HybridWorker

    vocab = len(load_tokenizer(tiny_path))
    cfg = RunConfig(
        model=ModelConfig(name="hf", path=tiny_path),
        # Every token ends a turn: each turn is one model token, then a call to the gate.
        engine=EngineConfig(max_new_tokens=4, stop_token_ids=list(range(vocab)), native=NativeOptions(impl=impl)),
        rollout=RolloutConfig(name="agent"),
        agent=AgentConfig(
            tools=[GATE],
            tool_options={"Gate": {"deadline_s": deadline_s}},
            tool_timeout_s=deadline_s + 60,
            max_turns=4,
            tools_in_prompt=False,
            format=f"{__name__}:every_turn_calls_the_gate",
            process=process,
        ),
    )
    return HybridWorker(cfg)


@pytest.mark.parametrize("impl, process", [("fused", "worker"), ("fused", "child"), ("hf", "worker")])
def test_a_quick_tools_trajectory_is_not_held_by_a_slow_one(tiny_path, tokenizer, process_group, impl, process):
    worker = agent_worker(tiny_path, impl, deadline_s=60.0 if impl == "fused" else 3.0, process=process)
    try:
        prompts = [chat_prompt(tokenizer, "Compute 12*7"), chat_prompt(tokenizer, "Compute 345*7")]
        worker.wake()
        params = SamplingParams(n=1, max_new_tokens=4, stop_token_ids=worker.cfg.engine.stop_token_ids)
        trajs = worker.generate(prompts, 0, params)
    finally:
        worker.roles.shutdown()
    assert [(t.turns, t.tool_calls, t.end_reason) for t in trajs] == [(4, 4, "max_turns")] * 2
    # Three calls run per trajectory; the last turn's call is not run.
    assert sum(m["role"] == "tool" for t in trajs for m in t.messages) == 6
    if impl == "fused":  # continuous batching: the other trajectory's next turn ran while call 1 was held
        assert gate_answer(trajs) == RELEASED, "the held tool call ran out its deadline: turns were batched per turn"
    else:  # the transformers path batches per turn: nothing runs while a live trajectory's tool is out
        assert gate_answer(trajs) == HELD
