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


# reward/* keys that are statistics of the reward, not components of it.
REWARD_STATS = (
    "reward/mean",
    "reward/std",
    "reward/max",
    "reward/kl_penalty_mean",
    "reward/solve_none_frac",
    "reward/zero_std_frac",
    "reward/errors",
    "reward/overlong_penalty_mean",
    "reward/generated_mean",
)


def reward_components(rows: list[dict]) -> list[str]:
    """The reward's components logged in `rows` (reward/format, reward/correct, ...), in first-seen order."""
    keys: list[str] = []
    for r in rows:
        keys.extend(k for k in r if k.startswith("reward/") and k not in REWARD_STATS and k not in keys)
    return keys


def first_last_means(values: list[float], frac: float = 0.2) -> tuple[float, float]:
    """Mean of the first and of the last `frac` of `values` (at least one value each)."""
    n = max(1, int(len(values) * frac))
    return sum(values[:n]) / n, sum(values[-n:]) / n


def plot_run(metrics_path: str | Path, out_path: str | Path) -> Path:
    """Write reward/mean and each reward component, and response/length_mean, against step (plus validation's
    val/reward_mean and val/accuracy when present); each reward curve's legend gives its mean over the first and last
    20% of steps, a validation curve's its last value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, key in enumerate(["reward/mean", *reward_components(rows)]):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if not points:
            continue
        first, last = first_last_means([v for _, v in points])
        axes[0].plot(
            *zip(*points),
            label=f"{key}  {first:.2f} → {last:.2f}",
            linewidth=2 if i == 0 else 1.2,
            linestyle="-" if i == 0 else "--",
        )
    for key, style in (("val/reward_mean", "o-"), ("val/accuracy", "s-")):
        val = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if val:
            axes[0].plot(*zip(*val), style, label=f"{key}  last {val[-1][1]:.2f}")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("reward")
    axes[0].legend(fontsize=8, title="first 20% → last 20%", title_fontsize=8)
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
