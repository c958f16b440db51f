"""Generate on a set of prompts through the worker group and score the answers: what validation during training and
`python -m hybridrl.evaluate` share, so the two give the same figures for the same model, prompts and sampling.

    batch, scores = generate_and_score(group, prompts, params, step, agent=cfg.rollout.name == "agent")
    correct = correct_flags(scores.scores, scores.extras)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridrl.agent import agent_metrics, trajectories_to_batch
from hybridrl.batch import Batch
from hybridrl.data.images import ImageInputs
from hybridrl.data.prompts import Prompt
from hybridrl.engines.base import Completion, SamplingParams
from hybridrl.phases import Phase
from hybridrl.rewards.base import RewardScores
from hybridrl.rewards.scoring import merge_scores
from hybridrl.workers.group import WorkerGroup


def prompt_images(prompts: Sequence[Prompt], vision) -> list[ImageInputs | None] | None:
    """Each prompt's images as its model reads them, processed once for this rollout (the engine and the trainer
    both read them); None for a text model (`vision`, the `VisionProcessor`, is None)."""
    if vision is None:
        return None
    return [vision.process(p.images) if p.images else None for p in prompts]


def completions_to_batch(
    prompts: Sequence[Prompt], comps: Sequence[Completion], images: Sequence[ImageInputs | None] | None = None
) -> Batch:
    """Response-aligned tensors (responses, mask, engine log-probs) for every completion; with `images` (per
    prompt), each row's in `meta["images"]` (the trainer's forward reads them) and their names as the data row gives
    them in `meta["image_names"]` (samples.jsonl)."""
    width = max(1, max(len(c.token_ids) for c in comps))
    resp = torch.zeros((len(comps), width), dtype=torch.long)
    mask = torch.zeros((len(comps), width), dtype=torch.float32)
    elp = torch.zeros((len(comps), width), dtype=torch.float32)
    for i, c in enumerate(comps):
        n = len(c.token_ids)
        resp[i, :n] = torch.tensor(c.token_ids, dtype=torch.long)
        mask[i, :n] = 1
        elp[i, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
    src = [prompts[c.prompt_index] for c in comps]
    meta = {
        "prompt_text": [p.text for p in src],
        "sample": [p.sample for p in src],
        "finish_reason": [c.finish_reason for c in comps],
    }
    if images is not None:
        meta["images"] = [images[c.prompt_index] for c in comps]  # a group's rows share one object
        meta["image_names"] = [[s.name for s in p.images or ()] for p in src]  # samples.jsonl names them
    return Batch(
        prompts=[p.token_ids for p in src],
        tensors={"responses": resp, "response_mask": mask, "engine_logprobs": elp},
        meta=meta,
    )


def rollout_batch(
    prompts: Sequence[Prompt], outs: list, agent: bool, images: Sequence[ImageInputs | None] | None = None
) -> tuple[Batch, dict[str, float]]:
    """The rollout as a batch: completions, or with rollout=agent trajectories (and their `agent/*` metrics)."""
    if agent:
        return trajectories_to_batch(prompts, outs), agent_metrics(outs)
    return completions_to_batch(prompts, outs, images), {}


def score_batch_on_workers(group: WorkerGroup, batch: Batch) -> RewardScores:
    """The reward phase over `batch`, whatever its size: the last row is repeated so every rank gets an equal
    share, and the repeats are dropped from the result."""
    pad = group.topology.padding_rows(len(batch))
    padded = Batch.concat([batch, batch.select([len(batch) - 1] * pad)]) if pad else batch
    merged = merge_scores(group.run_scattered(Phase.REWARD, padded))
    n = len(batch)
    return RewardScores(merged.scores[:n], {k: v[:n] for k, v in merged.extras.items()}, merged.errors)


def generate_and_score(
    group: WorkerGroup, prompts: Sequence[Prompt], params: SamplingParams, step: int, agent: bool, vision=None
) -> tuple[Batch, RewardScores]:
    """`params.n` answers to every prompt (prompt i's samples at rows i*n .. i*n+n-1), and their rewards; `vision`
    (a `VisionProcessor`) processes the prompts' images."""
    images = prompt_images(prompts, vision)
    outs = group.generate([p.token_ids for p in prompts], step, params, images=images)
    batch, _ = rollout_batch(prompts, outs, agent, images)
    return batch, score_batch_on_workers(group, batch)


def correct_flags(scores: Sequence[float], extras: dict[str, list[float]]) -> list[bool]:
    """Whether each answer is exactly right: its `correct` (or `exact`) reward component is 1, or without such a
    component its score is at least 1. The rule of val/accuracy and of the evaluation's pass@k."""
    exact = extras.get("correct") or extras.get("exact")
    return [c >= 1.0 for c in exact] if exact else [s >= 1.0 for s in scores]
