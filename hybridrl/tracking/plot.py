"""Curves of a run (reward and response length over steps) as a PNG, from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl file (a torn last line, from a killed run, is skipped)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def plot_run(metrics_path: str | Path, out_path: str | Path) -> Path:
    """Write reward/mean and response/length_mean against step (plus val/* reward when present)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].plot(steps, [r.get("reward/mean") for r in rows], label="train reward/mean")
    val = [(r["step"], r["val/reward_mean"]) for r in rows if "val/reward_mean" in r]
    if val:
        axes[0].plot(*zip(*val), "o-", label="val/reward_mean")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("reward")
    axes[0].legend()
    axes[0].grid(alpha=0.3)
    axes[1].plot(steps, [r.get("response/length_mean") for r in rows], color="tab:orange")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("response length (tokens)")
    axes[1].grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
