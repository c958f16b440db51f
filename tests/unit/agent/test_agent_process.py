"""The agent loop in a child process (`agent.process=child`), served by the worker's native engine: the same
trajectories as in the worker's process, the partial rollout's too; a child that crashes, fails its job or stops
answering fails the phase with an error saying so, and the next phase gets a new child; closing stops it."""

from __future__ import annotations

import os
import time

import pytest

from hybridrl.agent import AgentConfig, AgentLoop
from hybridrl.agent import process as agent_process
from hybridrl.agent.parsers import ParsedTurn, ToolCall
from hybridrl.agent.process import child_process_for
from hybridrl.agent.testing import ScriptedAsyncEngine
from hybridrl.agent.tools import Tool
from hybridrl.engines.base import GenerationRequest, SamplingParams
from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.rollout.agent import generate_agent_partial

HERE = __name__


def calls_the_calculator(text: str) -> ParsedTurn:
    """`agent.format` of these tests: every turn is a call (a random-weight model writes none)."""
    return ParsedTurn(text, [ToolCall("calculator", {"expression": "6*7"})])


def calls_the_trap(text: str) -> ParsedTurn:
    return ParsedTurn(text, [ToolCall("trap", {})])


def cannot_parse(text: str) -> ParsedTurn:
    raise ValueError("this parser fails on purpose")


class Trap(Tool):
    """`mode` crash: the process exits (code 3) at the first call while `armed` names an existing file, removing it;
    block: the call blocks its event loop for `seconds` (an `acall` that computes instead of awaiting)."""

    name = "trap"

    def __init__(self, mode: str = "crash", armed: str = "", seconds: float = 0.0) -> None:
        self.mode, self.armed, self.seconds = mode, armed, seconds

    @property
    def is_async(self) -> bool:
        return self.mode == "block"

    def call(self, arguments):
        if self.armed and os.path.exists(self.armed):
            os.remove(self.armed)
            os._exit(3)
        return "ok"

    async def acall(self, arguments):
        time.sleep(self.seconds)
        return "ok"


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def worker_for(tiny_path, tok, process: str, **agent):
    from hybridrl.config import RunConfig
    from hybridrl.engines.config import EngineConfig
    from hybridrl.models.config import ModelConfig
    from hybridrl.rollout.config import RolloutConfig
    from hybridrl.workers.worker import HybridWorker

    agent = {"tools": ["calculator"], "format": f"{HERE}:calls_the_calculator", "max_turns": 3, **agent}
    cfg = RunConfig(
        model=ModelConfig(name="hf", path=tiny_path),
        # About one token in seven ends a turn: turns of different lengths, cut at different points.
        engine=EngineConfig(max_new_tokens=8, stop_token_ids=list(range(0, len(tok), 7))),
        rollout=RolloutConfig(name="agent"),
        agent=AgentConfig(tools_in_prompt=False, process=process, **agent),
    )
    worker = HybridWorker(cfg)
    worker.wake()
    return worker


def params_of(worker, n: int = 2) -> SamplingParams:
    return SamplingParams(n=n, max_new_tokens=8, seed=5, stop_token_ids=worker.cfg.engine.stop_token_ids)


def same(a, b) -> None:
    """The same trajectories: tokens, masks, turns and transcripts exactly; log-probs to float32 rounding (the
    batches a step runs differ with when each turn arrives)."""
    assert [(t.response_ids, t.response_mask, t.messages, t.turns, t.end_reason) for t in a] == [
        (t.response_ids, t.response_mask, t.messages, t.turns, t.end_reason) for t in b
    ]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, rel=1e-5, abs=1e-6)


def test_the_child_makes_the_trajectories_the_worker_makes(tiny_path, tokenizer, process_group):
    prompts = [tokenizer("hello there")["input_ids"], tokenizer("compute this")["input_ids"]]
    out = {}
    for mode in ("worker", "child"):
        worker = worker_for(tiny_path, tokenizer, mode)
        try:
            loop, engine = worker.roles.agent_loop, worker.roles.rollout.engine
            assert (child_process_for(loop, engine) is not None) == (mode == "child")
            runs = [worker.generate(prompts, 0, params_of(worker)) for _ in range(2)]  # the second reuses the child
            requests = [GenerationRequest(p, i, j) for i, p in enumerate(prompts) for j in range(2)]
            partial = generate_agent_partial(loop, engine, requests, [0, 0, 1, 1], 2, params_of(worker, 1))
        finally:
            worker.roles.shutdown()
        same(runs[0], runs[1])
        out[mode] = runs[0], partial
    same(out["child"][0], out["worker"][0])
    assert sum(t.tool_calls for t in out["child"][0]) > 0
    same(out["child"][1], out["worker"][1])  # every group asked for: each trajectory runs to its end
    assert all(t.finish_reason != "partial" for t in out["child"][1])


def test_a_crashed_child_fails_the_phase_and_the_next_gets_a_new_one(tiny_path, tokenizer, process_group, tmp_path):
    armed = tmp_path / "armed"
    armed.write_text("")
    worker = worker_for(
        tiny_path,
        tokenizer,
        "child",
        tools=[f"{HERE}:Trap"],
        tool_options={"Trap": {"mode": "crash", "armed": str(armed)}},
        format=f"{HERE}:calls_the_trap",
    )
    prompts = [tokenizer("hello there")["input_ids"]]
    try:
        with pytest.raises(HybridRLError, match="exited with code 3"):
            worker.generate(prompts, 0, params_of(worker))
        assert not armed.exists()
        trajs = worker.generate(prompts, 0, params_of(worker))  # a new child; the trap is disarmed
        assert len(trajs) == 2 and all(t.tool_calls for t in trajs)
    finally:
        worker.roles.shutdown()


def test_a_failed_job_reports_the_childs_error(tiny_path, tokenizer, process_group):
    worker = worker_for(tiny_path, tokenizer, "child", format=f"{HERE}:cannot_parse")
    try:
        with pytest.raises(HybridRLError, match="this parser fails on purpose"):
            worker.generate([tokenizer("hello there")["input_ids"]], 0, params_of(worker))
    finally:
        worker.roles.shutdown()


def test_a_child_whose_event_loop_blocks_fails_the_phase_by_its_deadline(
    tiny_path, tokenizer, process_group, monkeypatch
):
    monkeypatch.setattr(agent_process, "HEARTBEAT_DEADLINE_S", 2.0)
    worker = worker_for(
        tiny_path,
        tokenizer,
        "child",
        tools=[f"{HERE}:Trap"],
        tool_options={"Trap": {"mode": "block", "seconds": 120.0}},
        format=f"{HERE}:calls_the_trap",
    )
    try:
        t0 = time.monotonic()
        with pytest.raises(HybridRLError, match="no word from the agent loop's process in 2 s"):
            worker.generate([tokenizer("hello there")["input_ids"]], 0, params_of(worker))
        assert time.monotonic() - t0 < 60
    finally:
        worker.roles.shutdown()


def test_closing_the_loop_stops_its_child(tiny_path, tokenizer, process_group):
    worker = worker_for(tiny_path, tokenizer, "child")
    try:
        worker.generate([tokenizer("hello there")["input_ids"]], 0, params_of(worker))
        pid = worker.roles.agent_loop.child.pid
        assert pid is not None and _alive(pid)
    finally:
        worker.roles.shutdown()
    assert worker.roles.agent_loop.child is None and not _alive(pid)  # it closed its tools and returned


def test_where_the_loop_runs(tokenizer):
    with pytest.raises(ConfigError, match="agent.process must be one of auto, child, worker"):
        AgentConfig(process="yes")
    with pytest.raises(ConfigError, match="agent.format"):
        AgentConfig(format="no such format")
    engine = ScriptedAsyncEngine({}, [0])
    assert child_process_for(AgentLoop(AgentConfig(), tokenizer), engine) is None  # auto: only a native GPU engine
    with pytest.raises(HybridRLError, match="agent.process=child needs the native engine"):
        child_process_for(AgentLoop(AgentConfig(process="child"), tokenizer), engine)


def test_a_child_whose_worker_is_gone_stops_mid_job(tokenizer):
    """The worker's end of the socket closing (its process died) ends the child's job and the child, which closes its
    tools and exits rather than waiting for completions that will never come."""
    cfg = AgentConfig(tools=["calculator"], format=f"{HERE}:calls_the_calculator", tools_in_prompt=False)
    child = agent_process.AgentProcess(cfg, tokenizer)
    child._start()
    prompts = [tokenizer("hello there")["input_ids"]]
    child._send((agent_process.RUN, "generate", (prompts, SamplingParams(max_new_tokens=4, seed=1), None)))
    (kind, requests), *_ = child._receive(60.0)  # the job has started: its first turn waits on the worker's engine
    assert kind == agent_process.REQUESTS and len(requests) == 1
    process = child._process
    child._sock.close()
    process.join(30)
    assert process.exitcode == 0
