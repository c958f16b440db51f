"""Summarize a sweep's run dirs into a table (Markdown and CSV) and a plot of reward per job.

    python scripts/summarize_sweep.py multirun/2026-11-29/10-54-25 [--metric reward/mean] [--last-frac 0.2]

For every job folder holding metrics.jsonl: its overrides (.hydra/overrides.yaml), steps run, the
metric's mean over the first and last `--last-frac` of steps, the best validation reward, and the
final value; sorted best first. Writes summary.md, summary.csv and summary.png into the sweep dir.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import yaml

from hybridrl.tracking.plot import read_metrics


def summarize_job(job: Path, metric: str, frac: float) -> dict | None:
    metrics_path = job / "metrics.jsonl"
    if not metrics_path.exists():
        return None
    rows = [r for r in read_metrics(metrics_path) if r.get(metric) is not None]
    if not rows:
        return None
    overrides_path = job / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_path.read_text()) if overrides_path.exists() else []
    k = max(1, int(len(rows) * frac))
    first = sum(r[metric] for r in rows[:k]) / k
    last = sum(r[metric] for r in rows[-k:]) / k
    val = [r["val/reward_mean"] for r in rows if r.get("val/reward_mean") is not None]
    return {
        "job": job.name,
        "overrides": " ".join(overrides),
        "steps": rows[-1]["step"],
        f"{metric} first": round(first, 4),
        f"{metric} last": round(last, 4),
        "gain": round(last - first, 4),
        "best val/reward_mean": round(max(val), 4) if val else None,
        "train_s": round(sum(r.get("time/step", 0.0) for r in rows), 1),
        "curve": [(r["step"], r[metric]) for r in rows],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--metric", default="reward/mean")
    ap.add_argument("--last-frac", type=float, default=0.2, help="share of steps averaged at each end")
    args = ap.parse_args(argv)
    jobs = [
        s
        for j in sorted(args.sweep_dir.iterdir())
        if j.is_dir() and (s := summarize_job(j, args.metric, args.last_frac))
    ]
    if not jobs:
        print(f"error: no job with {args.metric} in {args.sweep_dir}", file=sys.stderr)
        return 2
    jobs.sort(key=lambda j: j[f"{args.metric} last"], reverse=True)
    cols = [c for c in jobs[0] if c != "curve"]
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    table += ["| " + " | ".join(str(j[c]) for c in cols) + " |" for j in jobs]
    (args.sweep_dir / "summary.md").write_text("\n".join(table) + "\n")
    with (args.sweep_dir / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(jobs)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for j in jobs:
        ax.plot(*zip(*j["curve"]), label=j["overrides"] or j["job"])
    ax.set_xlabel("step")
    ax.set_ylabel(args.metric)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.sweep_dir / "summary.png", dpi=110)
    print("\n".join(table))
    print(
        json.dumps(
            {
                "jobs": len(jobs),
                "written": [str(args.sweep_dir / n) for n in ("summary.md", "summary.csv", "summary.png")],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
