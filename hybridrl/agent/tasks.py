"""A synthetic tool task: products of numbers too long to multiply in one's head, with a verifiable reward.

A prompt asks for `a*b` (`Compute 48213*9127`); the answer is the exact product. A small model cannot multiply
five-digit numbers token by token, but it can copy the expression into a calculator call and copy the result
back: the tool is what makes the task solvable. Rows come from `make_calc_rows` (the same signature as
`hybridrl.data.synthetic.make_synthetic_rows`), or as JSONL files from the command line::

    python -m hybridrl.agent.tasks --output-dir data/calc     # train.jsonl and val.jsonl, for data=jsonl

Rewards (registered when this module is imported): `calc_exact` scores 1 when the last number of the final
assistant message equals the product, else 0; `calc_shaped` adds small credit for a calculator call that ran
(0.2) and for trying a call at all (0.1), so a model starting from random weights gets a signal before it ever
solves one. Both log `reward/exact`, `reward/tool_ok`, `reward/tried`, `reward/answered`.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path
from typing import Any

from hybridrl.errors import ConfigError
from hybridrl.rewards.base import RewardInput, per_sample
from hybridrl.rewards.registry import register_reward

_NUMBER = re.compile(r"-?\d+")
_TOOL_RESPONSE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.DOTALL)


def make_calc_rows(n: int, min_digits: int, max_digits: int, seed: int, exclude: set[str] | None = None) -> list[dict]:
    """`n` distinct rows {prompt, answer, task, digits} drawn from `seed`: a*b with each factor of
    min_digits..max_digits digits; `digits` ("a*b") is the row's identity (what `exclude` holds)."""
    if not 1 <= min_digits <= max_digits:
        raise ConfigError(
            f"data.synthetic.min_digits/max_digits must satisfy 1 <= min <= max, got {min_digits}, {max_digits}"
        )
    rng = random.Random(seed)
    seen = set(exclude or ())
    space = sum(9 * 10 ** (k - 1) for k in range(min_digits, max_digits + 1)) ** 2
    if n > space - len(seen):
        raise ConfigError(f"data.synthetic: only {space - len(seen)} distinct products left, asked for {n}")
    rows: list[dict] = []
    while len(rows) < n:
        a, b = (_number(rng, rng.randint(min_digits, max_digits)) for _ in range(2))
        key = f"{a}*{b}"
        if key in seen:
            continue
        seen.add(key)
        rows.append({"prompt": f"Compute {key}", "answer": str(a * b), "task": "calc", "digits": key})
    return rows


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def _trajectory_view(item: RewardInput) -> tuple[str, bool, bool]:
    """The final assistant message's text, whether any tool call ran without error, and whether a call was tried.

    Reads the conversation (`messages`: on the item when the reward input carries it, else in the sample row);
    without one, falls back to the decoded response: the text after the last </tool_response> is the final answer.
    """
    messages = getattr(item, "messages", None) or item.sample.get("messages")
    if messages:
        final = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        tool_said = [str(m.get("content", "")) for m in messages if m.get("role") == "tool"]
        tried = bool(tool_said) or any(m.get("tool_calls") for m in messages)
        return final, any(not t.startswith("Error") for t in tool_said), tried
    text = item.response
    ok = any(not r.startswith("Error") for r in _TOOL_RESPONSE.findall(text))
    final = text.rsplit("</tool_response>", 1)[-1]
    final = re.sub(r"<tool_call>.*?(</tool_call>|$)", "", final, flags=re.DOTALL)
    return final, ok, "<tool_call>" in text


def calc_components(item: RewardInput) -> dict[str, float]:
    """exact (the final message's last number is the product), tool_ok (a call ran without error), tried (a tool
    call was attempted, well-formed or not), answered (the final message holds a number)."""
    final, ok, tried = _trajectory_view(item)
    numbers = _NUMBER.findall(final.replace(",", ""))
    answered = bool(numbers)
    exact = answered and numbers[-1].lstrip("0") == str(item.sample["answer"]).lstrip("0")
    return {"exact": float(exact), "tool_ok": float(ok), "tried": float(tried), "answered": float(answered)}


@register_reward("calc_exact")
@per_sample
def calc_exact(item: RewardInput) -> dict[str, Any]:
    """1 for the exact product as the final message's last number, else 0."""
    parts = calc_components(item)
    return {"score": parts["exact"], **parts}


@register_reward("calc_shaped")
@per_sample
def calc_shaped(item: RewardInput) -> dict[str, Any]:
    """exact + 0.2 * (a tool call ran) + 0.1 * (a tool call was tried): in [0, 1.3]. The small terms give a model
    that starts from random weights a gradient toward calling the tool before it ever solves a product."""
    parts = calc_components(item)
    return {"score": parts["exact"] + 0.2 * parts["tool_ok"] + 0.1 * parts["tried"], **parts}


def main(argv: list[str] | None = None) -> None:
    """Write train.jsonl and val.jsonl (disjoint) of the calc task."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--train", type=int, default=4096)
    ap.add_argument("--val", type=int, default=64)
    ap.add_argument("--min-digits", type=int, default=4)
    ap.add_argument("--max-digits", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = make_calc_rows(args.train, args.min_digits, args.max_digits, args.seed)
    val = make_calc_rows(
        args.val, args.min_digits, args.max_digits, args.seed + 1, exclude={r["digits"] for r in train}
    )
    for name, rows in (("train", train), ("val", val)):
        with (out / f"{name}.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(train)} + {len(val)} rows to {out}")


if __name__ == "__main__":
    main()
