"""Running tool calls off the event loop, with timeouts, and turning every failure into a message for the model.

Synchronous tools run in the runner's own thread pool (sized by `agent.max_concurrent_tools`, so sixteen blocking
calls do not queue behind asyncio's small default pool); asynchronous tools (`acall`) are awaited. Either way the
event loop stays free, so one trajectory's tool call does not stall the other trajectories. A call that raises,
times out, names an unknown tool, has bad arguments or returns something that is not text comes back as
`ToolOutcome(error=True)` with an "Error: ..." message; nothing here raises into the loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hybridrl.agent.parsers import ToolCall
from hybridrl.agent.tools.base import Tool, ToolError, check_arguments

TRUNCATION_MARK = "\n...(output truncated)"


@dataclass
class ToolOutcome:
    """The result of one call, as the model will read it."""

    name: str
    """The tool the model called (as written)."""
    content: str
    """The tool's output, or an "Error: ..." message."""
    error: bool
    """True when the call failed in any way (counted in `agent/tool_errors`)."""
    seconds: float
    """Wall-clock time of the call."""


def to_text(value: object) -> str:
    """A tool's return value as text: strings as they are, JSON-able values as JSON; anything else is an error."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, int, float, bool)) and not isinstance(value, type):
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            pass
    raise ToolError(f"the tool returned {type(value).__name__}, not text")


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, the cut marked (the marker counts toward the limit)."""
    if len(text) <= limit:
        return text
    return text[: max(0, limit - len(TRUNCATION_MARK))] + TRUNCATION_MARK


class ToolRunner:
    """Executes `ToolCall`s against a set of tools; one per worker, shared by all trajectories in flight."""

    def __init__(
        self,
        tools: Mapping[str, Tool],
        timeout_for: Callable[[str], float],
        max_output_chars: int = 2000,
        max_concurrent: int = 32,
    ) -> None:
        self.tools = dict(tools)
        self.timeout_for = timeout_for
        self.max_output_chars = max_output_chars
        self.max_concurrent = max_concurrent
        self._pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="hybridrl-tool")
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:  # a new asyncio.run per step gets a new one
            self._slots, self._slots_loop = asyncio.Semaphore(self.max_concurrent), loop
        return self._slots

    def error(self, name: str, message: str, seconds: float = 0.0) -> ToolOutcome:
        """An error outcome (also used by the loop for malformed calls and over-limit calls)."""
        return ToolOutcome(name, clip(f"Error: {message}", self.max_output_chars), True, seconds)

    async def run(self, call: ToolCall) -> ToolOutcome:
        """Run one call; always returns (errors become `ToolOutcome(error=True)`)."""
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return self.error(call.name, f"unknown tool {call.name!r}; available tools: {known}")
        timeout = self.timeout_for(call.name)
        async with self._semaphore():
            t0 = time.perf_counter()
            try:
                check_arguments(tool.parameters, call.arguments, call.name)
                if tool.is_async:
                    value = await asyncio.wait_for(tool.acall(call.arguments), timeout)
                else:
                    fut = asyncio.get_running_loop().run_in_executor(self._pool, tool.call, call.arguments)
                    # The thread of a timed-out synchronous call runs on to its end; its result is dropped.
                    value = await asyncio.wait_for(fut, timeout)
                text = to_text(value)
            except asyncio.TimeoutError:
                return self.error(
                    call.name, f"tool {call.name!r} timed out after {timeout:g} s", time.perf_counter() - t0
                )
            except ToolError as e:
                return self.error(call.name, str(e), time.perf_counter() - t0)
            except Exception as e:  # a tool's own bug must not end the run
                return self.error(
                    call.name, f"tool {call.name!r} raised {type(e).__name__}: {e}", time.perf_counter() - t0
                )
            return ToolOutcome(call.name, clip(text, self.max_output_chars), False, time.perf_counter() - t0)

    def close(self) -> None:
        """Close every tool and stop the thread pool (without waiting for calls that timed out)."""
        for tool in self.tools.values():
            try:
                tool.close()
            except Exception:
                pass
        self._pool.shutdown(wait=False, cancel_futures=True)
