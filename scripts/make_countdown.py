"""Generate a Countdown task file (JSONL): numbers, a reachable target, and the prompt.

    python scripts/make_countdown.py --output data/countdown_train.jsonl --n 20000 --seed 0
    python scripts/make_countdown.py --output data/countdown_val.jsonl --n 500 --seed 1

Every target is reached by a random expression over the numbers, so each row is solvable.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from fractions import Fraction
from pathlib import Path

INSTRUCTION = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use + - * / and each "
    "number exactly once. Show your work, then give the equation in <answer> </answer> tags, "
    "for example <answer>(1 + 2) / 3</answer>."
)


def random_target(numbers: list[int], rng: random.Random) -> tuple[int, str] | None:
    """Combine the numbers in a random order and tree; an integer result in 1..999 is a target."""
    items = [(Fraction(n), str(n)) for n in numbers]
    rng.shuffle(items)
    while len(items) > 1:
        i, j = sorted(rng.sample(range(len(items)), 2))
        (a, ea), (b, eb) = items[i], items[j]
        op = rng.choice("+-*/")
        if op == "/" and b == 0:
            return None
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
        items = [x for k, x in enumerate(items) if k not in (i, j)] + [(value, f"({ea} {op} {eb})")]
    value, expr = items[0]
    if value.denominator != 1 or not 1 <= value <= 999:
        return None
    return int(value), expr


def make_rows(n: int, seed: int, count: tuple[int, int] = (3, 4), high: int = 50) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        numbers = [rng.randint(1, high) for _ in range(rng.randint(*count))]
        found = random_target(numbers, rng)
        if found is None:
            continue
        target, solution = found
        prompt = INSTRUCTION.format(numbers=", ".join(map(str, numbers)), target=target)
        rows.append(
            {"prompt": prompt, "numbers": numbers, "target": target, "answer": str(target), "solution": solution}
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", required=True, type=Path)
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="replace an existing output file")
    args = ap.parse_args(argv)
    if args.output.exists() and not args.force:
        print(f"error: {args.output} exists; pass --force to replace it", file=sys.stderr)
        return 2
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_name(args.output.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in make_rows(args.n, args.seed)))
    os.replace(tmp, args.output)
    print(json.dumps({"output": str(args.output), "rows": args.n}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
