"""The end-of-run summary: the figures a user looks for, from metrics.jsonl, in a few console lines.

summary: 150 steps, 0.15 s per step (update 0.07, logprob 0.04, generate 0.02); first 20% -> last 20% of steps
  reward/mean     0.466 -> 0.897
  reward/correct  0.098 -> 0.795
  val/accuracy    0.000 (step 25) -> 0.859 (step 150); val/reward_mean 0.507 -> 0.979
  model           outputs/.../checkpoints/step_000150  (python -m hybridrl.export ...; hybridrl.evaluate ...)
  plot            outputs/.../plots.png
  objective       0.8970 = reward/mean over the last 20% of steps (what a sweep maximizes)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridrl.tracking.plot import first_last_means, reward_components

PHASES_SHOWN = 3
"""The slowest phases named in the time-per-step line."""


def _series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if r.get(key) is not None]


def _rel(path: str | Path) -> str:
    """A path relative to the working folder when it lies under it (shorter to copy), else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def run_summary(
    rows: list[dict[str, Any]],
    objective: float,
    model_at: str | Path | None = None,
    plot_at: str | Path | None = None,
    frac: float = 0.2,
) -> str:
    """The summary's lines (see the module docstring) for a run's metrics rows."""
    if not rows:
        return "summary: no step was logged"
    step_times = [v for _, v in _series(rows, "time/step")]
    head = f"summary: {len(rows)} steps"
    if step_times:
        per_step = sum(step_times) / len(step_times)
        phases = sorted(
            ((k[5:], sum(r.get(k) or 0.0 for r in rows) / len(rows)) for k in rows[-1] if k.startswith("time/")),
            key=lambda kv: -kv[1],
        )
        named = ", ".join([f"{p} {t:.2f}" for p, t in phases if p != "step"][:PHASES_SHOWN])
        head += f", {per_step:.2f} s per step ({named})"
    lines = [head + f"; mean of the first {frac:.0%} -> last {frac:.0%} of steps:"]
    keys = ["reward/mean", *reward_components(rows)]
    width = max(len(k) for k in [*keys, "val/accuracy", "objective"])
    for key in keys:
        values = [v for _, v in _series(rows, key)]
        if values:
            first, last = first_last_means(values, frac)
            lines.append(f"  {key:<{width}}  {first:.3f} -> {last:.3f}")
    val = _validation(rows)
    if val:
        lines.append(f"  {'val/accuracy':<{width}}  {val}")
    if model_at:
        at, pad = _rel(model_at), " " * (width + 4)
        lines.append(f"  {'model':<{width}}  {at}")
        lines.append(f"{pad}score it:  python -m hybridrl.evaluate model.path={at}")
        lines.append(f"{pad}export it: python -m hybridrl.export --checkpoint {at} --output <folder>")
    if plot_at and Path(plot_at).exists():
        lines.append(f"  {'plot':<{width}}  {_rel(plot_at)}")
    lines.append(
        f"  {'objective':<{width}}  {objective:.4f} = reward/mean over the last {frac:.0%} of steps "
        "(what a sweep maximizes)"
    )
    return "\n".join(lines)


def _validation(rows: list[dict[str, Any]]) -> str | None:
    """`0.000 (step 25) -> 0.859 (step 150); val/reward_mean 0.507 -> 0.979`, or None without validation."""
    acc = _series(rows, "val/accuracy")
    if not acc:
        return None
    text = f"{acc[0][1]:.3f} (step {acc[0][0]})"
    if len(acc) > 1:
        text += f" -> {acc[-1][1]:.3f} (step {acc[-1][0]})"
    reward = _series(rows, "val/reward_mean")
    if reward:
        text += f"; val/reward_mean {reward[0][1]:.3f}" + (f" -> {reward[-1][1]:.3f}" if len(reward) > 1 else "")
    return text
