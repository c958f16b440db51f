"""The built-in verifiable task: short digit puzzles with exact answers and a graded reward.

A prompt is an instruction and some digits (`sort: 4172`); the answer is a digit string
(`1247`). The reward gives partial credit per correct position, so a policy starting from
random weights gets a signal from its first steps and the learning curve is visible on a CPU.
"""

from __future__ import annotations

import random

from hybridrl.errors import ConfigError
from hybridrl.rewards.base import RewardInput, per_sample
from hybridrl.rewards.registry import register_reward


def _answer(task: str, digits: str) -> str:
    if task == "copy":
        return digits
    if task == "reverse":
        return digits[::-1]
    if task == "sort":
        return "".join(sorted(digits))
    if task == "add":
        half = len(digits) // 2 or 1
        return str(int(digits[:half]) + int(digits[half:] or "0"))
    raise ValueError(f"unknown synthetic task {task!r}")


def _prompt(task: str, digits: str) -> str:
    if task == "add":
        half = len(digits) // 2 or 1
        return f"add: {digits[:half]}+{digits[half:] or '0'}"
    return f"{task}: {digits}"


def make_synthetic_rows(
    task: str, n: int, min_digits: int, max_digits: int, seed: int, exclude: set[str] | None = None
) -> list[dict]:
    """`n` distinct rows {prompt, answer, task} drawn deterministically from `seed`."""
    if task == "calc":  # arithmetic too long to do in the head: the agent loop's calculator task
        from hybridrl.agent.tasks import make_calc_rows

        return make_calc_rows(n, min_digits, max_digits, seed, exclude)
    rng = random.Random(seed)
    rows: list[dict] = []
    seen = set(exclude or ())
    space = sum(10**k for k in range(min_digits, max_digits + 1))
    if n > space - len(seen):
        raise ConfigError(
            f"data.synthetic: only {space - len(seen)} distinct prompts with {min_digits}..{max_digits} digits "
            f"are left, asked for {n}; lower data.synthetic.num_prompts / num_val_prompts or raise max_digits"
        )
    while len(rows) < n:
        k = rng.randint(min_digits, max_digits)
        digits = "".join(rng.choice("0123456789") for _ in range(k))
        if digits in seen:
            continue
        seen.add(digits)
        rows.append({"prompt": _prompt(task, digits), "answer": _answer(task, digits), "task": task, "digits": digits})
    return rows


def digit_match_score(response: str, answer: str) -> float:
    """Fraction of answer positions matched, over the longer of response and answer (1.0 = exact)."""
    got = response.strip()
    if not got and not answer:
        return 1.0
    hits = sum(1 for a, b in zip(got, answer) if a == b)
    return hits / max(len(got), len(answer))


@register_reward("synthetic")
@per_sample
def synthetic_reward(item: RewardInput) -> dict[str, float]:
    """Half format, half correctness, each in [0, 1].

    format: the share of response characters that are digits, halved when the sample was cut
    off instead of ending with EOS; correct: `digit_match_score` against the answer. Logged
    separately (reward/format, reward/correct, reward/exact) so a curve shows which one moved.
    """
    got = item.response.strip()
    answer = str(item.sample["answer"])
    digit_share = sum(ch.isdigit() for ch in got) / len(got) if got else 0.0
    fmt = digit_share * (1.0 if item.finish_reason == "stop" else 0.5)
    correct = digit_match_score(got, answer)
    return {"score": 0.5 * fmt + 0.5 * correct, "format": fmt, "correct": correct, "exact": float(got == answer)}
