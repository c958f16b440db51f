"""Trajectories → the controller's `Batch` (the agent counterpart of `controller.completions_to_batch`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridrl.agent.loop import Trajectory
from hybridrl.batch import Batch
from hybridrl.data.prompts import Prompt


def trajectories_to_batch(prompts: Sequence[Prompt], trajectories: Sequence[Trajectory]) -> Batch:
    """Response-aligned tensors for every trajectory, right-padded to the longest response.

    responses                 [B, R] every token after the prompt (model, tool and template tokens)
    response_mask             [B, R] 1 on model tokens only: the loss, the KL and the mismatch metrics read this
    response_attention_mask   [B, R] 1 on every real response token (model and tool), 0 on padding: the length of
                              the sequence the trainer must feed the model (`response_mask` has holes where tools
                              spoke, so its sum is not the length)
    engine_logprobs           [B, R] the engine's log-probs on model tokens, 0 elsewhere

    meta: prompt_text, sample, finish_reason as for single-turn rollouts, plus messages (the conversation) and the
    per-trajectory counters turns, tool_calls, tool_errors, truncated, end_reason.
    """
    width = max(1, max((len(t.response_ids) for t in trajectories), default=0))
    rows = len(trajectories)
    resp = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.float32)
    attn = torch.zeros((rows, width), dtype=torch.float32)
    elp = torch.zeros((rows, width), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        n = len(t.response_ids)
        if n:
            resp[i, :n] = torch.tensor(t.response_ids, dtype=torch.long)
            mask[i, :n] = torch.tensor(t.response_mask, dtype=torch.float32)
            attn[i, :n] = 1
            elp[i, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
    src = [prompts[t.prompt_index] for t in trajectories]
    return Batch(
        prompts=[list(t.prompt_ids) for t in trajectories],
        tensors={"responses": resp, "response_mask": mask, "response_attention_mask": attn, "engine_logprobs": elp},
        meta={
            "prompt_text": [p.text for p in src],
            "sample": [p.sample for p in src],
            "finish_reason": [t.finish_reason for t in trajectories],
            "messages": [t.messages for t in trajectories],
            "turns": [t.turns for t in trajectories],
            "tool_calls": [t.tool_calls for t in trajectories],
            "tool_errors": [t.tool_errors for t in trajectories],
            "truncated": [t.truncated for t in trajectories],
            "end_reason": [t.end_reason for t in trajectories],
        },
    )
