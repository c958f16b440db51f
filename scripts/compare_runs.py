"""How far two runs' metrics are apart, key by key (e.g. the same seed on 1 and on 2 GPUs); JSON out.

    python scripts/compare_runs.py outputs/one_gpu outputs/two_gpus [--steps 5]

For every metric both runs logged (timings, memory, offload and reshard figures left out: they are not what was
learned), the largest absolute and relative gap over the first --steps common steps, and the step it occurs at.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybridrl.tracking.plot import read_metrics  # noqa: E402

VOLATILE = ("time/", "perf/", "memory/", "offload/", "reshard/")


def gaps(a: list[dict], b: list[dict], steps: int | None = None) -> dict[str, dict]:
    """{key: {abs, rel, step}} of the largest gap per key over the common steps."""
    by_step = {r["step"]: r for r in b}
    common = [r for r in a if r["step"] in by_step][:steps]
    out: dict[str, dict] = {}
    for row in common:
        other = by_step[row["step"]]
        for key, x in row.items():
            y = other.get(key)
            if (
                key == "step"
                or key.startswith(VOLATILE)
                or not isinstance(x, (int, float))
                or not isinstance(y, (int, float))
            ):
                continue
            diff = abs(x - y)
            rel = diff / max(abs(x), abs(y), 1e-12)
            if key not in out or diff > out[key]["abs"]:
                out[key] = {"abs": diff, "rel": rel, "step": row["step"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--steps", type=int, default=None, help="compare only the first N common steps")
    args = ap.parse_args(argv)
    g = gaps(read_metrics(args.run_a / "metrics.jsonl"), read_metrics(args.run_b / "metrics.jsonl"), args.steps)
    worst = sorted(g.items(), key=lambda kv: kv[1]["rel"], reverse=True)
    print(json.dumps({"keys": len(g), "largest_rel_gaps": dict(worst[:15]), "all": g}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
