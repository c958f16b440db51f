"""A few rollout samples per step — prompt, response, reward and its components — for reading, not plotting.

The controller, on the steps `samples_due(step)` allows (every `logger.samples_every` steps)::

    idx = pick_samples(len(batch), cfg.logger.samples_per_step, cfg.algorithm.group_size)
    tracker.log_samples(step, sample_rows(batch, idx, tokenizer, scores, extras))

`samples.jsonl` in the run dir gets one JSON object per sample; with `logger=wandb` each call also logs a
wandb Table under the key "samples".
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from hybridrl.rewards.scoring import response_text

SAMPLES_FILE = "samples.jsonl"
TABLE_KEY = "samples"
"""The wandb key the Table is logged under."""


def pick_samples(n_rows: int, k: int, group_size: int = 1) -> list[int]:
    """Up to `k` row indices spread evenly over the batch, first sample of different prompts where possible."""
    if k <= 0 or n_rows <= 0:
        return []
    groups = max(1, n_rows // max(1, group_size))
    if k <= groups:  # one sample from each of k prompt groups spread over the batch
        return [(g * groups // k) * group_size for g in range(k)]
    if k >= n_rows:
        return list(range(n_rows))
    return [i * n_rows // k for i in range(k)]


def sample_rows(
    batch, indices: list[int], tokenizer, scores: list[float], extras: dict[str, list[float]]
) -> list[dict[str, Any]]:
    """Rows for `log_samples` from a rollout batch (hybridrl.batch.Batch) and its rewards.

    Each row: prompt (the rendered text the policy saw), response (decoded, special tokens dropped), answer
    (the data row's reference, when it has one), images (a vision-language prompt's, as the data row names
    them), reward, reward/<component> for each component, and
    finish_reason ("stop" or "length")."""
    rows = []
    for i in indices:
        row: dict[str, Any] = {"prompt": batch.meta["prompt_text"][i], "response": response_text(batch, i, tokenizer)}
        if "image_names" in batch.meta:  # a vision-language prompt's images, as its data row names them
            row["images"] = list(batch.meta["image_names"][i])
        sample = batch.meta["sample"][i]
        if isinstance(sample, dict) and "answer" in sample:
            row["answer"] = _plain(sample["answer"])
        row["reward"] = float(scores[i])
        row.update({f"reward/{k}": float(v[i]) for k, v in extras.items()})
        row["finish_reason"] = batch.meta["finish_reason"][i]
        rows.append(row)
    return rows


def _plain(value: Any) -> Any:
    """JSON-friendly value: numbers and strings as they are, lists item by item, anything else as its text."""
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):  # a prompt's image paths
        return [_plain(v) for v in value]
    return str(value)


class SampleLog:
    """Appends sample rows to samples.jsonl (flushed each call); `resume_at` drops rows past a checkpoint."""

    def __init__(self, run_dir: str | Path, every: int, per_step: int) -> None:
        self.path = Path(run_dir) / SAMPLES_FILE
        self.every, self.per_step = every, per_step

    def due(self, step: int) -> bool:
        """True on the steps samples are written (every `every` steps, counting from 1; never when 0)."""
        return self.every > 0 and self.per_step > 0 and (step == 1 or step % self.every == 0)

    def write(self, step: int, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Append `rows` (at most per_step of them), each with "step" first; returns what was written."""
        out = [{"step": step, **{k: _plain(v) for k, v in row.items()}} for row in rows[: self.per_step]]
        if out:
            with self.path.open("a") as f:
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
        return out

    def resume_at(self, step: int) -> None:
        """Keep only rows with step <= `step` (a resumed run rewrites what followed its checkpoint)."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)


def wandb_table(rows: list[dict[str, Any]]):
    """The rows as a wandb.Table (columns in first-seen order; a missing cell is None)."""
    import wandb

    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    return wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
