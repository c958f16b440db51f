"""Agent rollouts (`rollout=agent`): multi-turn tool calling, token in and token out.

tools = prompt_tool_schemas(cfg.agent)                      # prompts: apply_chat_template(msgs, tools=tools)
loop = AgentLoop(cfg.agent, tokenizer)                      # tools, tool-call parser, chat template
trajs = loop.generate_sync(engine, prompt_ids, params)      # params.n per prompt; params.seed = step seed
batch = trajectories_to_batch(prompts, trajs)               # response_mask = 1 on model tokens only
metrics = agent_metrics(trajs)                              # agent/turns_mean, agent/tool_errors, ...
"""

from hybridrl.agent.batch import trajectories_to_batch
from hybridrl.agent.config import AgentConfig
from hybridrl.agent.engine import (
    AsyncGenerator,
    ContinuousEngine,
    LaneAware,
    RequestEngine,
    TurnBatchingAdapter,
    as_async_engine,
)
from hybridrl.agent.loop import AgentLoop, Trajectory, turn_seed
from hybridrl.agent.metrics import agent_metrics
from hybridrl.agent.parsers import ParsedTurn, ToolCall, get_parser
from hybridrl.agent.tools import Tool, ToolError, build_tools, prompt_tool_schemas

__all__ = [
    "AgentConfig",
    "AgentLoop",
    "AsyncGenerator",
    "ContinuousEngine",
    "LaneAware",
    "ParsedTurn",
    "RequestEngine",
    "Tool",
    "ToolCall",
    "ToolError",
    "Trajectory",
    "TurnBatchingAdapter",
    "agent_metrics",
    "as_async_engine",
    "build_tools",
    "get_parser",
    "prompt_tool_schemas",
    "trajectories_to_batch",
    "turn_seed",
]
