"""Per-step `agent/*` metrics from a batch of trajectories (a pure function over the loop's outputs)."""

from __future__ import annotations

from collections.abc import Sequence

from hybridrl.agent.loop import Trajectory


def agent_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Turns and tool use of one step's trajectories.

    agent/turns_mean        assistant turns per trajectory
    agent/tool_calls_mean   tool calls per trajectory (well-formed or not)
    agent/tool_errors       failed calls in the step (raised, timed out, malformed, unknown tool, over a limit)
    agent/tool_error_rate   tool_errors / tool calls (0 when no call was made)
    agent/tool_seconds      wall-clock seconds of all tool calls, summed (calls overlap, so this can exceed the
                            generate phase's time)
    agent/truncated_frac    share of trajectories a limit ended (turns, total tokens, a turn's token cap)
    agent/model_tokens_mean model-generated tokens per trajectory (the trained ones; tool tokens excluded)
    """
    n = len(trajectories)
    if n == 0:
        return {}
    calls = sum(t.tool_calls for t in trajectories)
    errors = sum(t.tool_errors for t in trajectories)
    return {
        "agent/turns_mean": sum(t.turns for t in trajectories) / n,
        "agent/tool_calls_mean": calls / n,
        "agent/tool_errors": float(errors),
        "agent/tool_error_rate": errors / calls if calls else 0.0,
        "agent/tool_seconds": float(sum(t.tool_seconds for t in trajectories)),
        "agent/truncated_frac": sum(t.truncated for t in trajectories) / n,
        "agent/model_tokens_mean": sum(t.model_tokens for t in trajectories) / n,
    }
