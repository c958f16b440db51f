"""Tools the agent loop offers the model: built-ins by name, user tools by import path.

    build_tools(["calculator", "python", "my_pkg.tools:WebSearch"], {"python": {"memory_mb": 512}, "WebSearch": {...}})

Built-ins: `calculator` (safe arithmetic), `python` (a local child process with rlimits; not a security
boundary), `sandbox_fusion` (code sent to a SandboxFusion service; the model sees it as `python`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hybridrl.agent.config import AgentConfig, tool_option_key
from hybridrl.agent.tools.base import Tool, ToolError, check_arguments
from hybridrl.errors import ConfigError
from hybridrl.import_path import load_import_path

__all__ = [
    "BUILTIN_TOOLS",
    "Tool",
    "ToolError",
    "build_tools",
    "check_arguments",
    "load_tool_class",
    "prompt_tool_schemas",
]

BUILTIN_TOOLS: dict[str, str] = {
    "calculator": "hybridrl.agent.tools.calculator:Calculator",
    "python": "hybridrl.agent.tools.python:PythonTool",
    "sandbox_fusion": "hybridrl.agent.tools.remote:SandboxFusionTool",
}


def load_tool_class(entry: str) -> type[Tool]:
    """The Tool subclass a built-in name or a `pkg.module:Class` path names; ConfigError naming `agent.tools`."""
    path = BUILTIN_TOOLS.get(entry, entry)
    if ":" not in path:
        raise ConfigError(
            f"agent.tools entry {entry!r} is not a built-in tool ({', '.join(BUILTIN_TOOLS)}); "
            "give your own as 'pkg.module:Class'"
        )
    cls = load_import_path(path, "agent.tools")
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ConfigError(f"agent.tools entry {entry!r} names {cls!r}, not a subclass of hybridrl.agent.tools.Tool")
    if not cls.name:
        raise ConfigError(f"agent.tools entry {entry!r}: {cls.__name__} sets no `name`")
    return cls


def build_tools(entries: Sequence[str], options: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Tool]:
    """One instance per entry, keyed by the name the model calls; keyword arguments from
    `options[tool_option_key(entry)]` (the built-in name, or the class name of an import path)."""
    options = options or {}
    tools: dict[str, Tool] = {}
    for entry in entries:
        cls = load_tool_class(entry)
        key = tool_option_key(entry)
        kwargs = dict(options.get(key, {}))
        try:
            tool = cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"agent.tool_options.{key}: building tool {entry!r} failed: {e}") from e
        if tool.name in tools:
            raise ConfigError(f"agent.tools: two tools are named {tool.name!r}; the model could not tell them apart")
        tools[tool.name] = tool
    return tools


def prompt_tool_schemas(cfg: AgentConfig) -> list[dict[str, Any]] | None:
    """What prompt rendering passes as `apply_chat_template(messages, tools=...)`: the schemas of `cfg.tools`,
    or None with `agent.tools_in_prompt=false` (the tools are then offered without being described)."""
    if not cfg.tools_in_prompt or not cfg.tools:
        return None
    tools = build_tools(cfg.tools, cfg.tool_options)
    try:
        return [t.schema() for t in tools.values()]
    finally:
        for t in tools.values():
            t.close()
