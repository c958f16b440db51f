"""Does the CPU demo learn as well with partial rollouts? `reward/correct` over the last 20% of steps, synchronous and
`rollout=partial`, on several seeds; JSON out.

    python -m benchmarks.partial_demo                                     # seeds 0 1 2: six runs of the CPU demo
    python -m benchmarks.partial_demo --seeds 0 --set trainer.steps=20    # a quick look

Each run is `python -m hybridrl` (the CPU demo: the tiny model, the synthetic digit task, 150 steps) with
trainer.seed=s (the seeds recipes/recipe/cpu_demo.yaml reports; the data stay those of data.seed) and responses capped
at --max-new-tokens, once as it is and once with `rollout=partial` (50% more groups started, stop once
data.train_batch_size groups are complete and some sample has a tail, tails carried at most one version) and the
rollout correction --correction (token_mis: masked IS of each token), in its own process, one after the other, in a
folder under --work-dir. The acceptance is |partial − sync| ≤ 0.05 on every seed.

Why a correction: carried tokens were sampled a version ago, and trained as if sampled now
(`algorithm.rollout_correction=none`) they pulled every partial run of seeds 0-2 (on an Intel Xeon) into writing one
first digit for every number (`9959` for 3959): reward/correct 0.64-0.67 against the synchronous 0.81-0.87. Masking the
tokens whose probability moved past the bounds since they were sampled (token_mis) kept them within 0.05
(docs/partial-rollouts.md, "The CPU demo").

The cap is 16 tokens, not the recipe's 8: the demo's answers take about 5 tokens, and a sample that has not stopped
by then is a tail only where its cap leaves more tokens than the rollout has run. At 8 nothing ever is, the engine
runs on, and the partial run equals the synchronous one step for step; at 16 about half the steps carry samples
(`carried_mean` below), so the comparison is of carried tails. The tiny run at a learning rate of 2e-3 is chaotic (a
run that parts from another early ends where a different seed would): docs/partial-rollouts.md has the figures.

JSON: `seeds`, per seed `sync` and `partial` (reward/correct over the last 20% of steps, and for the partial run
the mean of rollout/carried, the steps that carried any, the means of rollout/dropped, rollout/tails_finished and
rollout/staleness_mean over its steps, and `same_steps`, the leading steps whose reward/correct equals the
synchronous run's) and `difference` (partial − sync), then `max_abs_difference`, `within_0_05`, and the
labels `max_new_tokens`, `correction` and `overrides`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import emit, note
from hybridrl.algorithms.config import ROLLOUT_CORRECTIONS
from hybridrl.tracking.plot import first_last_means, read_metrics

TOLERANCE = 0.05


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m benchmarks.partial_demo`."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.partial_demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="trainer.seed of each pair")
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=16,
        help="engine.max_new_tokens of every run (16: room for tails; the recipe's 8 leaves none)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for every run, e.g. trainer.steps=50 (repeatable)",
    )
    ap.add_argument(
        "--correction",
        default="token_mis",
        choices=ROLLOUT_CORRECTIONS,
        help="algorithm.rollout_correction of the partial runs (the synchronous ones keep the recipe's)",
    )
    ap.add_argument("--work-dir", default=None, help="where the runs' folders go (default: a new temporary folder)")
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    return ap


def run(args: list[str], run_dir: Path) -> list[dict]:
    """One `python -m hybridrl` run into `run_dir`; its metrics rows."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "hybridrl", *args, "logger.progress_bar=false", f"hydra.run.dir={run_dir}"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return read_metrics(run_dir / "metrics.jsonl")


def tail_mean(rows: list[dict], key: str) -> float:
    """The mean of `key` over the last 20% of the steps."""
    return first_last_means([r[key] for r in rows])[1]


def mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def same_steps(a: list[dict], b: list[dict], key: str) -> int:
    """How many leading steps have the same `key` in both runs."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x[key] != y[key]:
            return i
    return min(len(a), len(b))


def main() -> None:
    """Run the pairs the command line asks for and print the JSON."""
    args = parser().parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="partial_demo_"))
    per_seed = {}
    for seed in args.seeds:
        common = [f"trainer.seed={seed}", f"engine.max_new_tokens={args.max_new_tokens}", *args.set]
        note(f"seed {seed}: synchronous")
        sync = run(common, work / f"sync_{seed}")
        note(f"seed {seed}: rollout=partial")
        partial = run(
            ["rollout=partial", f"algorithm.rollout_correction={args.correction}", *common], work / f"partial_{seed}"
        )
        s, p = tail_mean(sync, "reward/correct"), tail_mean(partial, "reward/correct")
        per_seed[seed] = {
            "sync": {"reward_correct_last20": s, "steps": len(sync)},
            "partial": {
                "reward_correct_last20": p,
                "steps": len(partial),
                "carried_mean": mean(partial, "rollout/carried"),
                "steps_carrying": sum(r["rollout/carried"] > 0 for r in partial),
                "dropped_mean": mean(partial, "rollout/dropped"),
                "tails_finished_mean": mean(partial, "rollout/tails_finished"),
                "staleness_mean": mean(partial, "rollout/staleness_mean"),
                "same_steps": same_steps(sync, partial, "reward/correct"),
            },
            "difference": p - s,
        }
        note(f"seed {seed}: reward/correct over the last 20%: sync {s:.3f}, partial {p:.3f}")
    worst = max(abs(v["difference"]) for v in per_seed.values())
    result = {
        "seeds": per_seed,
        "max_abs_difference": worst,
        "within_0_05": worst <= TOLERANCE,
        "max_new_tokens": args.max_new_tokens,
        "correction": args.correction,
        "overrides": args.set,
        "work_dir": str(work),
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
