"""Config of the agent loop (`agent.*`), read when `rollout=agent`.

    python -m hybridrl rollout=agent agent.tools=[calculator,python] agent.max_turns=4
    python -m hybridrl rollout=agent 'agent.tools=[my_pkg.tools:WebSearch]' agent.tool_options.WebSearch.url=...

`AgentConfig` is the root's `agent` section, read only when `rollout.name=agent` (the `rollout` group's config is
`hybridrl.rollout.config.RolloutConfig`). Checks run in `__post_init__` and name the key they reject.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from hybridrl.errors import ConfigError

TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral")
TOOL_ERROR_POLICIES = ("message", "stop")
TRUNCATION_POLICIES = ("keep", "mask")
PROCESS_MODES = ("auto", "child", "worker")
_NAME_RE = re.compile(r"^[A-Za-z_][\w-]*$")
_IMPORT_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def tool_option_key(entry: str) -> str:
    """The key of an `agent.tools` entry in `agent.tool_options`: the name of a built-in, the class name of an
    import path (`my_pkg.tools:WebSearch` → `WebSearch`, so the CLI key has no dots or colon)."""
    return entry.rsplit(":", 1)[-1]


@dataclass
class AgentConfig:
    """The agent loop: turns, token budget, tools, the tool-call format and the failure policies."""

    max_turns: int = 4
    """Most assistant turns (engine generations) per trajectory; a tool call in the last turn is not run (truncated)."""
    max_total_tokens: int = 1024
    """Budget of the whole sequence (prompt + model tokens + tool tokens); reaching it truncates the trajectory."""
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    """Tools offered: built-in names (calculator, python, sandbox_fusion) or import paths `pkg.module:Class`."""
    tool_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Keyword arguments per tool, by built-in or class name (`+agent.tool_options.python.memory_mb=512`)."""
    format: str = "hermes"
    """Tool-call format: hermes (Qwen2.5/Qwen3 `<tool_call>`), llama3_json, mistral (`[TOOL_CALLS]`), or your own
    parser as an import path `pkg.module:function` (a turn's text to `hybridrl.agent.parsers.ParsedTurn`)."""
    tools_in_prompt: bool = True
    """Render the tools' JSON schemas into the prompt (the chat template's `tools=`); off for models that can't."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one tool call, in seconds; a call that exceeds it returns an error message to the model."""
    tool_timeouts: dict[str, float] = field(default_factory=dict)
    """Per-tool wall-clock limits by tool name, overriding `tool_timeout_s` (e.g. {python: 30})."""
    max_tool_calls_per_turn: int = 4
    """Most tool calls run from one assistant turn; extra calls get an error message."""
    max_tool_output_chars: int = 2000
    """Longest tool output passed back to the model, in characters (longer output is cut, with a marker)."""
    max_concurrent_trajectories: int = 0
    """Trajectories in flight at once per worker; 0 runs all of a step's trajectories concurrently."""
    max_concurrent_tools: int = 32
    """Tool calls running at once per worker (also the size of the thread pool for synchronous tools)."""
    on_tool_error: str = "message"
    """message: a failed call (raised, timed out, malformed, unknown tool) becomes an error message and the loop
    continues; stop: the trajectory ends after the failed call. Either way the failure is counted."""
    process: str = "auto"
    """Where the loop's own work (parsing turns, running tools, rendering tool turns) runs: `child`, a child process
    per worker fed turns by the worker's native engine, so it does not share the interpreter lock with the engine's
    driver; `worker`, the worker's process; `auto`, `child` where the native engine runs on a GPU (its driver steps
    every millisecond or two and would wait for the agents), else `worker`. vLLM and SGLang serve it in the worker."""
    on_truncation: str = "keep"
    """keep: truncated trajectories train like any other; mask: their response_mask is zeroed (no loss, DAPO-style
    overlong filtering) while they stay in the batch."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"agent.max_turns must be >= 1, got {self.max_turns}")
        if self.max_total_tokens < 2:
            raise ConfigError(f"agent.max_total_tokens must be >= 2, got {self.max_total_tokens}")
        for entry in self.tools:
            if not isinstance(entry, str) or not (_NAME_RE.match(entry) or _IMPORT_RE.match(entry)):
                raise ConfigError(
                    f"agent.tools entry {entry!r} is neither a tool name (calculator, python, sandbox_fusion) nor an "
                    "import path 'pkg.module:Class'"
                )
        if len(set(self.tools)) != len(self.tools):
            raise ConfigError(f"agent.tools lists a tool twice: {list(self.tools)}")
        keys = [tool_option_key(e) for e in self.tools]
        if len(set(keys)) != len(keys):
            raise ConfigError(f"agent.tools: two entries share a class name ({list(self.tools)}); rename one class")
        for key in self.tool_options:
            if key not in keys:
                raise ConfigError(
                    f"agent.tool_options.{key} names no tool of agent.tools ({list(self.tools)}); key options by the "
                    f"built-in name or the class name: {keys}"
                )
        if self.format not in TOOL_CALL_FORMATS and not _IMPORT_RE.match(self.format):
            raise ConfigError(
                f"agent.format must be one of {', '.join(TOOL_CALL_FORMATS)} or an import path 'pkg.module:function', "
                f"got {self.format!r}"
            )
        if not self.tool_timeout_s > 0:
            raise ConfigError(f"agent.tool_timeout_s must be > 0, got {self.tool_timeout_s}")
        for name, t in self.tool_timeouts.items():
            if not t > 0:
                raise ConfigError(f"agent.tool_timeouts.{name} must be > 0, got {t}")
        if self.max_tool_calls_per_turn < 1:
            raise ConfigError(f"agent.max_tool_calls_per_turn must be >= 1, got {self.max_tool_calls_per_turn}")
        if self.max_tool_output_chars < 16:
            raise ConfigError(f"agent.max_tool_output_chars must be >= 16, got {self.max_tool_output_chars}")
        if self.max_concurrent_trajectories < 0:
            raise ConfigError(
                f"agent.max_concurrent_trajectories must be >= 0 (0 = all), got {self.max_concurrent_trajectories}"
            )
        if self.max_concurrent_tools < 1:
            raise ConfigError(f"agent.max_concurrent_tools must be >= 1, got {self.max_concurrent_tools}")
        if self.on_tool_error not in TOOL_ERROR_POLICIES:
            raise ConfigError(
                f"agent.on_tool_error must be one of {', '.join(TOOL_ERROR_POLICIES)}, got {self.on_tool_error!r}"
            )
        if self.process not in PROCESS_MODES:
            raise ConfigError(f"agent.process must be one of {', '.join(PROCESS_MODES)}, got {self.process!r}")
        if self.on_truncation not in TRUNCATION_POLICIES:
            raise ConfigError(
                f"agent.on_truncation must be one of {', '.join(TRUNCATION_POLICIES)}, got {self.on_truncation!r}"
            )

    def timeout_for(self, tool_name: str) -> float:
        """The wall-clock limit of a call to `tool_name`."""
        return float(self.tool_timeouts.get(tool_name, self.tool_timeout_s))
