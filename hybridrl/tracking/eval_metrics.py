"""The figures of an evaluation: pass@k, mean reward and its components, response length; and their console table.

pass@k is the unbiased estimator of Chen et al. 2021 (arXiv:2107.03374, the Codex paper): with n samples of a prompt
of which c are correct, pass@k = 1 - C(n - c, k) / C(n, k), averaged over prompts. pass@1 is the mean correctness.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c of them correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def k_values(n: int) -> list[int]:
    """The k reported for n samples per prompt: 1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks if ks[-1] == n else [*ks, n]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def eval_figures(
    n: int,
    scores: Sequence[float],
    extras: dict[str, Sequence[float]],
    correct: Sequence[bool],
    lengths: Sequence[int],
    finish_reasons: Sequence[str],
) -> dict[str, float]:
    """Figures over samples laid out prompt by prompt (prompt i's n samples at i*n .. i*n+n-1)."""
    if len(scores) % n:
        raise ValueError(f"{len(scores)} samples do not split into groups of n={n}")
    per_prompt = [sum(correct[i : i + n]) for i in range(0, len(correct), n)]
    out: dict[str, float] = {"prompts": len(per_prompt), "samples": len(scores)}
    for k in k_values(n):
        out[f"pass@{k}"] = _mean([pass_at_k(n, c, k) for c in per_prompt])
    out["reward/mean"] = _mean(scores)
    out.update({f"reward/{key}": _mean(values) for key, values in extras.items()})
    out["response/length_mean"] = _mean(lengths)
    out["response/length_max"] = float(max(lengths, default=0))
    out["response/clip_frac"] = _mean([r == "length" for r in finish_reasons])
    return out


def figures_table(figures: dict[str, Any]) -> str:
    """The figures as an aligned two-column table (counts as integers, the rest with 4 digits)."""
    width = max(len(k) for k in figures)
    lines = [f"  {'metric':<{width}}  value", f"  {'-' * width}  -----"]
    for key, value in figures.items():
        text = str(int(value)) if key in ("prompts", "samples") else f"{value:.4f}"
        lines.append(f"  {key:<{width}}  {text}")
    return "\n".join(lines)
