"""The expected figures the recipes and the docs promise, in a form a test can check against a run's metrics.

Two places state them, with one grammar for a figure:

- a recipe header line:            `# expect: reward/correct first 0.10 last 0.80 ±0.05`
- a table in a markdown page, between `<!-- expected-figures -->` and `<!-- /expected-figures -->`:

      | run | metric | figure | tolerance |
      |---|---|---|---|
      | `python -m hybridrl` | `reward/correct` | first 0.10, last 0.80 | ±0.05 |

A figure is one or more of: `first V` / `last V` (the metric's mean over the first / last 20% of the steps that log
it, as plots.png and the run's summary give them), `step N V` (its value at step N), `all < V` (every step below V),
`gain > V` (last minus first: how much the run learned);
the tolerance is `±T` (absolute). Where runs of other seeds spread wider than a useful tolerance, a figure states a
bound instead, which needs no tolerance: `last > V`, `first < V`, `step N > V` (the values every seed tried
reached). The metric `wall_s` is the run's wall time in seconds, start-up included, with the tiny model already
made, and takes a factor instead: `wall_s 40 x2` (between 20 and 80 s); it is checked only on an idle machine. A
recipe that cannot run here says `# expect: none (why)`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from hybridrl.tracking.plot import first_last_means

EXPECT = re.compile(r"^#\s*expect:\s*(?P<body>.*)$")
TABLE_START, TABLE_END = "<!-- expected-figures -->", "<!-- /expected-figures -->"


@dataclass(frozen=True)
class Check:
    """One figure: `kind` first | last | gain | step | all_below | wall, at step `step` (kind step), expected
    `value`; `op` "=" (within the tolerance), ">" or "<" (a bound)."""

    kind: str
    value: float
    step: int | None = None
    op: str = "="


@dataclass
class Expectation:
    """The figures one line promises for one metric of one run."""

    source: str
    """Where the line is (recipes/recipe/cpu_lora.yaml, README.md)."""
    overrides: tuple[str, ...]
    """The run's command-line overrides (`recipe=cpu_lora`; none for the default run)."""
    metric: str
    checks: list[Check] = field(default_factory=list)
    tolerance: float = 0.0
    """Absolute tolerance; for wall_s the factor."""
    text: str = ""

    @property
    def label(self) -> str:
        run = " ".join(self.overrides) or "default"
        return f"{Path(self.source).name}:{run}:{self.metric}"


def parse_figure(body: str, source: str, overrides: tuple[str, ...]) -> Expectation:
    """An Expectation from `<metric> <figure>... <tolerance>`; ValueError naming the source on bad grammar."""
    words = body.replace(",", " ").split()
    if len(words) < 3:
        raise ValueError(f"{source}: expected '<metric> <figure>... <tolerance>', got {body!r}")
    metric, *rest = words
    exp = Expectation(source, overrides, metric, text=body)
    if metric == "wall_s":
        tol_word = rest.pop() if rest else ""
        if not tol_word.startswith(("x", "×")) or len(rest) != 1:
            raise ValueError(f"{source}: wall_s takes one value and a factor, e.g. 'wall_s 40 x2', got {body!r}")
        exp.tolerance = float(tol_word[1:])
        exp.checks.append(Check("wall", float(rest[0])))
        return exp
    if rest and rest[-1].startswith(("±", "+-")):
        exp.tolerance = float(rest.pop().lstrip("±+-"))
        has_tolerance = True
    else:
        has_tolerance = False
    i = 0
    try:
        while i < len(rest):
            word = rest[i]
            if word not in ("first", "last", "step", "all", "gain"):
                raise ValueError(f"{source}: unknown figure {word!r} in {body!r} (first, last, step N, all <, gain >)")
            step = None
            if word == "step":
                step = int(rest[i + 1])
                i += 1
            op = rest[i + 1] if rest[i + 1] in ("<", ">") else "="
            if word == "all" and op != "<":
                raise ValueError(f"{source}: 'all' takes '< V', got {body!r}")
            if word == "gain" and op != ">":
                raise ValueError(f"{source}: 'gain' takes '> V', got {body!r}")
            value = float(rest[i + 2] if op != "=" else rest[i + 1])
            kind = "all_below" if word == "all" else word
            exp.checks.append(Check(kind, value, step, "<" if kind == "all_below" else op))
            i += 3 if op != "=" else 2
    except IndexError:
        raise ValueError(f"{source}: a figure lacks its value in {body!r}") from None
    if any(c.op == "=" for c in exp.checks) and not has_tolerance:
        raise ValueError(f"{source}: the tolerance comes last as ±T (or state a bound: last > V) in {body!r}")
    if not exp.checks:
        raise ValueError(f"{source}: no figure in {body!r}")
    return exp


def recipe_expectations(path: Path, source: str) -> tuple[list[Expectation], str | None]:
    """The `# expect:` lines of a recipe's header, and the reason it gives when it expects none."""
    out, none_reason = [], None
    overrides = (f"recipe={path.stem}",)
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        m = EXPECT.match(line)
        if not m:
            continue
        body = m.group("body").strip()
        if body.startswith("none"):
            none_reason = body[4:].strip(" ()") or "no reason given"
            continue
        out.append(parse_figure(body, source, overrides))
    return out, none_reason


def table_expectations(text: str, source: str) -> list[Expectation]:
    """The rows of every expected-figures table in a markdown page."""
    out, inside = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped == TABLE_START:
            inside = True
            continue
        if stripped == TABLE_END:
            inside = False
            continue
        if not inside or not stripped.startswith("|") or set(stripped) <= set("|-: "):
            continue
        cells = [c.strip().strip("`").strip() for c in stripped.strip("|").split("|")]
        if cells[0].lower() == "run":
            continue
        if len(cells) != 4:
            raise ValueError(f"{source}: an expected-figures row has 4 cells (run, metric, figure, tolerance): {line}")
        run, metric, figure, tol = cells
        words = shlex.split(run)
        if words[:3] != ["python", "-m", "hybridrl"]:
            raise ValueError(f"{source}: the run column holds a `python -m hybridrl ...` command, got {run!r}")
        out.append(parse_figure(f"{metric} {figure} {tol}", source, tuple(words[3:])))
    return out


def measure(check: Check, rows: list[dict], metric: str, wall_s: float | None = None) -> float:
    """The run's value for `check` (the maximum over steps for all_below)."""
    if check.kind == "wall":
        return float(wall_s)
    values = [(r["step"], r[metric]) for r in rows if r.get(metric) is not None]
    if not values:
        raise AssertionError(f"the run logged no {metric}")
    if check.kind in ("first", "last", "gain"):
        first, last = first_last_means([v for _, v in values])
        return {"first": first, "last": last, "gain": last - first}[check.kind]
    if check.kind == "step":
        at = [v for s, v in values if s == check.step]
        if not at:
            raise AssertionError(f"the run logged no {metric} at step {check.step}")
        return at[0]
    return max(v for _, v in values)


def holds(check: Check, measured: float, tolerance: float) -> bool:
    """Whether `measured` agrees with the figure: within its tolerance, or on the right side of its bound."""
    if check.kind == "wall":
        return check.value / tolerance <= measured <= check.value * tolerance
    if check.op == "<":
        return measured < check.value
    if check.op == ">":
        return measured > check.value
    return abs(measured - check.value) <= tolerance + 1e-9
