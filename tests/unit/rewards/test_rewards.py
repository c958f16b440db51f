"""Rewards: the math verifier on tricky answers, format/combinator, registry and custom loading, config, and
the GSM8K converter."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import textwrap
from pathlib import Path

import pytest

from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.rewards import (
    RewardConfig,
    RewardInput,
    extract_answer,
    format_reward,
    math_reward,
    math_with_format_reward,
    normalize_number,
    normalize_results,
    register_reward,
    registered_rewards,
    registry,
    resolve_reward,
)
from tests.paths import REPO

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def item(response: str, answer: object = "72", finish_reason: str = "stop", key: str = "answer") -> RewardInput:
    return RewardInput(prompt="Q: ...", response=response, sample={key: answer}, finish_reason=finish_reason)


# (response, reference answer, expected reward). Decisions pinned here: the `####` marker wins over any later
# number or \boxed; \boxed wins over a later plain number; "1e3" is scientific notation for 1000 (it used to be
# read as its last digit run, a wrong verdict); a marker line that starts with words is not a marker.
VERIFIER_CASES = [
    ("The answer is 72 dollars.", "72", 1.0),
    ("Step by step ... so #### 72", GSM8K_SOLUTION, 1.0),
    ("She paid $1,234.50 in total.", "1234.5", 1.0),
    ("#### $1,234.50", "1234.50", 1.0),
    ("#### \\$1,234.50 dollars", "1234.5", 1.0),
    ("Total: 1,000,000", "1000000", 1.0),
    ("#### 1,234,567,890,123", "1234567890123", 1.0),
    ("So the temperature is -5 degrees", "-5", 1.0),
    ("The result is \u22125", "-5", 1.0),
    ("#### \u22125", "-5", 1.0),
    ("3-5", "-5", 0.0),  # a subtraction, not a negative number: the answer read is 5
    ("He ate 3/4 of the pie", "0.75", 1.0),
    ("\\boxed{\\frac{3}{4}}", "3/4", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", ".5", 1.0),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    ("\\boxed{\\text{72 apples}}", "72", 1.0),
    ("\\boxed{\\$1{,}234}", "1234", 1.0),
    ("\\boxed{1\\,234}", "1234", 1.0),
    ("First 10, then 20, finally 30", "30", 1.0),
    ("First 10, then 20, finally 30", "10", 0.0),
    ("#### 72\nCheck: 72 + 5 = 77", "72", 1.0),
    ("#### 72\nCheck: 72 + 5 = 77", "77", 0.0),
    ("\\boxed{72} and then 5 more", "72", 1.0),
    ("\\boxed{7} so ... #### 72", "72", 1.0),
    ("The answer is \\boxed{72", "72", 1.0),  # cut-off \boxed: falls back to the last number
    ("I don't know.", "72", 0.0),
    ("", "72", 0.0),
    ("The discount is 25%.", "25", 1.0),
    ("#### 72.", "72", 1.0),
    ("#### +72", "72", 1.0),
    ("#### 5.00", "5", 1.0),
    ("0.50", "1/2", 1.0),
    (".5", "\\frac{1}{2}", 1.0),
    ("1e3", "1000", 1.0),
    ("The answer is 72", "72.0001", 0.0),
    ("0.3333333", "1/3", 1.0),  # within the 1e-6 relative tolerance
    ("0.333", "1/3", 0.0),
    ("#### 8", "#### 80", 0.0),
    ("x = 12", "12", 1.0),
    ("**Answer: 18**", "18", 1.0),
    ("#### **$18**", "18", 1.0),
    ("#### Step 1\nWe add them, which gives 42", "42", 1.0),  # a markdown heading is not the marker
    ("#### 72. Check: 70 + 2 = 72, plus 5", "72", 1.0),
    ("x^2 = 49 so x = 7", "7", 1.0),
    ("#### 1/2", "0.5", 1.0),
    ("#### 5", 5, 1.0),  # a numeric reference
    ("#### 0", "0", 1.0),
    ("0.0000001", "0", 0.0),
]


@pytest.mark.parametrize("response,answer,expected", VERIFIER_CASES)
def test_math_verifier(response: str, answer: object, expected: float) -> None:
    assert math_reward(item(response, answer)) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("0.50", "0.5"),
        (".5", "0.5"),
        ("1/2", "0.5"),
        ("1/3", "1/3"),
        ("$1,234.50", "1234.5"),
        ("\u22125", "-5"),
        ("\\frac{3}{4}", "0.75"),
        ("\\dfrac{-3}{4}", "-0.75"),
        ("\\frac12", "0.5"),
        ("+7", "7"),
        ("72 dollars.", "72"),
        ("(5)", "5"),
        ("50\\%", "50"),
        ("90^\\circ", "90"),
        ("3 to 5", None),
        ("1,2", None),
        ("abc", None),
        ("1e3", "1000"),
        ("5/0", None),
        ("", None),
        (None, None),
    ],
)
def test_normalize_number(text: str | None, expected: str | None) -> None:
    assert normalize_number(text) == expected


class _CountingPattern:
    """A compiled regex that adds the length of every string it is asked to scan to `meter[0]`."""

    def __init__(self, pattern, meter: list[int]) -> None:
        self._p, self._meter = pattern, meter

    def __getattr__(self, name):
        attr = getattr(self._p, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self._meter[0] += max((len(a) for a in args if isinstance(a, str)), default=0)
            return attr(*args, **kwargs)

        return counted


def _work(fn, text: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """Deterministic work of `fn(item(text))`: Python lines run in hybridrl.rewards plus characters given to regexes.

    A stand-in for wall-clock time that does not depend on the machine or its load: a quadratic scan (a Python loop
    per \\boxed, or a regex rescanning the text from each start) shows as ~16x the work for 4x the input.
    """
    import re as _re

    from hybridrl.rewards import math_answer

    meter = [0]
    for name, value in vars(math_answer).items():
        if isinstance(value, _re.Pattern):
            monkeypatch.setattr(math_answer, name, _CountingPattern(value, meter))
    module_re = _CountingPattern(_re, meter)  # re.sub(...)/re.match(...) called through the module
    monkeypatch.setattr(math_answer, "re", module_re)
    roots = (str(Path(math_answer.__file__).parent), __file__)  # the rewards package, and this file's stand-ins

    def tracer(frame, event, arg):
        if frame.f_code.co_filename.startswith(roots):
            if event == "line":
                meter[0] += 1
            return tracer
        return None

    sys.settrace(tracer)
    try:
        fn(item(text, "5"))
    finally:
        sys.settrace(None)
        monkeypatch.undo()
    return meter[0]


@pytest.mark.parametrize(
    "make",
    [
        lambda n: "\\boxed{" * n,
        lambda n: "{" * n + "}" * 3,
        lambda n: "#### " + "9" * n,
        lambda n: "9" * n + "/" + "3" * n,
        lambda n: "1," * n,
        lambda n: "\\boxed{1} " * n,
    ],
    ids=["unclosed-boxed", "braces", "long-marker", "huge-fraction", "commas", "many-boxed"],
)
def test_pathological_text_is_safe_and_linear(make, monkeypatch: pytest.MonkeyPatch) -> None:
    for fn in (math_reward, format_reward, math_with_format_reward):
        fn(item(make(20000), "5"))  # never raises
    assert math_reward(item(make(20000), "5")) in (0.0, 1.0)
    for fn in (math_reward, format_reward, math_with_format_reward):
        small, large = _work(fn, make(1000), monkeypatch), _work(fn, make(4000), monkeypatch)
        assert large <= 5 * small, (fn.__name__, small, large)  # linear: 4x; a quadratic scan: 16x


def test_the_work_meter_sees_a_quadratic_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The meter above must be able to fail: a scan from every \\boxed start (the bug it guards) is caught."""
    from hybridrl.rewards import math_answer

    def quadratic_boxed(text: str):
        last = None
        for m in math_answer._BOXED_RE.finditer(text):
            depth = 0
            for ch in text[m.end() :]:  # rescans the rest of the text from each start
                depth += ch == "{"
                depth -= ch == "}"
            last = m
        return last

    monkeypatch.setattr(math_answer, "extract_boxed", quadratic_boxed)
    make = lambda n: "\\boxed{" * n  # noqa: E731
    small = _work(lambda it: math_answer.extract_boxed(it.response), make(100), monkeypatch)
    monkeypatch.setattr(math_answer, "extract_boxed", quadratic_boxed)
    large = _work(lambda it: math_answer.extract_boxed(it.response), make(400), monkeypatch)
    assert large > 10 * small


def test_extract_answer_priority() -> None:
    assert extract_answer("#### 3\n\\boxed{4} 5") == "3"
    assert extract_answer("\\boxed{\\frac{1}{2}} then 7") == "\\frac{1}{2}"
    assert extract_answer("no digits here") is None
    assert extract_answer(None) is None


def test_math_reward_reference_fields() -> None:
    assert math_reward(item("72", "72", key="ground_truth")) == 1.0
    assert math_reward(item("72", "no number here")) == 0.0  # unparseable reference scores 0, warns once
    with pytest.raises(HybridRLError, match="'answer' or 'ground_truth'"):
        math_reward(RewardInput("p", "72", {"question": "q"}, "stop"))


@pytest.mark.parametrize(
    "response,finish,expected",
    [
        ("so #### 72", "stop", 1.0),
        ("so #### 72", "length", 0.0),
        ("so \\boxed{72}", "stop", 1.0),
        ("so \\boxed{}", "stop", 0.0),
        ("the answer is 72", "stop", 0.0),
        ("#### The answer is 72", "stop", 0.0),
        ("#### \u22125", "stop", 1.0),
    ],
)
def test_format_reward(response: str, finish: str, expected: float) -> None:
    assert format_reward(item(response, finish_reason=finish)) == expected


def test_math_with_format_components() -> None:
    assert math_with_format_reward(item("#### 72")) == {"score": 1.0, "correct": 1.0, "format": 1.0}
    assert math_with_format_reward(item("#### 72", finish_reason="length")) == pytest.approx(
        {"score": 0.9, "correct": 1.0, "format": 0.0}
    )
    assert math_with_format_reward(item("#### 71")) == pytest.approx({"score": 0.1, "correct": 0.0, "format": 1.0})
    fn = resolve_reward("math_with_format")
    scores, extras = normalize_results(fn([item("#### 72"), item("71")]), expected=2)
    assert scores == pytest.approx([1.0, 0.0])
    assert extras == {"correct": [1.0, 0.0], "format": [1.0, 0.0]}


def test_builtins_registered_and_batched() -> None:
    assert {"math", "format", "math_with_format"} <= set(registered_rewards())
    assert resolve_reward("math")([item("#### 72"), item("#### 1")]) == [1.0, 0.0]


def test_normalize_results_errors() -> None:
    torch = pytest.importorskip("torch")
    assert normalize_results(torch.tensor([0.5, 1.0])) == ([0.5, 1.0], {})
    assert normalize_results([]) == ([], {})
    with pytest.raises(HybridRLError, match="2 results for 3 items"):
        normalize_results([1.0, 0.0], expected=3)
    with pytest.raises(HybridRLError, match="differ in form"):
        normalize_results([{"score": 1.0}, 0.0])
    with pytest.raises(HybridRLError, match="without key 'score'"):
        normalize_results([{"correct": 1.0}])
    with pytest.raises(HybridRLError, match="same keys"):
        normalize_results([{"score": 1.0, "a": 1.0}, {"score": 1.0}])
    with pytest.raises(HybridRLError, match="finite"):
        normalize_results([math.nan])
    with pytest.raises(HybridRLError, match="must return a list"):
        normalize_results(1.0)  # type: ignore[arg-type]


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test vanish after it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_ORIGINS", dict(registry._ORIGINS))


def test_register_reward_either_form(clean_registry: None) -> None:
    @register_reward("test_len")
    def by_len(item: RewardInput) -> float:
        return float(len(item.response))

    assert by_len(item("abc")) == 3.0  # the decorator returns the function unchanged
    assert resolve_reward("test_len")([item("a"), item("ab")]) == [1.0, 2.0]
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_len")(lambda it: 0.0)


def test_unknown_name_lists_registered() -> None:
    with pytest.raises(ConfigError, match=r"reward\.name='nope'.*'math'.*reward\.fn="):
        resolve_reward("nope")


CUSTOM_MODULE = """
from __future__ import annotations
from hybridrl.rewards import RewardInput, batched, per_sample

def exact(item: RewardInput) -> float:           # per-sample by annotation
    return float(item.response.strip() == str(item.sample["answer"]))

def plain(item):                                  # per-sample by default
    return 1.0 if "yes" in item.response else 0.0

def many(items: list[RewardInput]) -> list[float]:  # batched by annotation (a string here)
    return [float(len(items))] * len(items)

@batched
def many_unannotated(items):                      # batched by marker
    return [2.0 for _ in items]

@per_sample
def marked(item):                                 # already batched by @per_sample
    return {"score": 0.5, "len": float(len(item.response))}

class Scorer:
    def __call__(self, items: list) -> list:
        return [3.0] * len(items)

scorer = Scorer()
NOT_CALLABLE = 3
"""


def _write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_custom_function_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(tmp_path, monkeypatch, "my_rewards_forms", CUSTOM_MODULE)
    items = [item("72"), item("yes")]
    assert resolve_reward("my_rewards_forms:exact")(items) == [1.0, 0.0]
    assert resolve_reward("my_rewards_forms:plain")(items) == [0.0, 1.0]
    assert resolve_reward("my_rewards_forms:many")(items) == [2.0, 2.0]
    assert resolve_reward("my_rewards_forms:many_unannotated")(items) == [2.0, 2.0]
    assert resolve_reward("my_rewards_forms:scorer")(items) == [3.0, 3.0]
    scores, extras = normalize_results(resolve_reward(" my_rewards_forms:marked ")(items), expected=2)
    assert scores == [0.5, 0.5] and extras == {"len": [2.0, 3.0]}


@pytest.mark.parametrize(
    "spec,match",
    [
        ("my_rewards_errs:missing", r"reward\.fn=.*no attribute 'missing'.*'exact'"),
        ("my_rewards_errs:NOT_CALLABLE", r"reward\.fn=.*not callable"),
        ("my_rewards_errs:Scorer", r"reward\.fn=.*a class"),
        ("no_such_pkg_xyz.mod:f", r"reward\.fn=.*cannot import module 'no_such_pkg_xyz.mod'.*PYTHONPATH"),
        ("my_rewards_broken:f", r"reward\.fn=.*importing 'my_rewards_broken' failed.*install 'dep_missing_xyz'"),
        ("my_rewards_raises:f", r"reward\.fn=.*raised RuntimeError: boom"),
        ("a.b:c:d", r"reward\.fn=.*not of the form 'pkg\.module:func'"),
        ("a.b:", r"reward\.fn=.*not of the form"),
    ],
)
def test_custom_function_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str, match: str) -> None:
    _write_module(tmp_path, monkeypatch, "my_rewards_errs", CUSTOM_MODULE)
    _write_module(tmp_path, monkeypatch, "my_rewards_broken", "import dep_missing_xyz\n")
    _write_module(tmp_path, monkeypatch, "my_rewards_raises", "raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match=match):
        resolve_reward(spec)


def test_reward_config() -> None:
    # spec: fn (when set) wins over name, surrounding whitespace dropped; no dependence on the defaults.
    assert RewardConfig(name=" math ").spec == "math"
    assert RewardConfig(name="math", fn=" pkg.mod:f ").spec == "pkg.mod:f"
    assert RewardConfig(name="format", fn=None).spec == "format"
    with pytest.raises(ConfigError, match=r"reward\.fn"):
        RewardConfig(fn="pkg.mod.f")
    with pytest.raises(ConfigError, match=r"reward\.name"):
        RewardConfig(name=" ")
    with pytest.raises(ConfigError, match=r"set reward\.fn="):
        RewardConfig(name="pkg.mod:f")
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.merge(omegaconf.OmegaConf.structured(RewardConfig), {"name": "math"})
    assert omegaconf.OmegaConf.to_object(cfg) == RewardConfig(name="math")
    with pytest.raises(ConfigError, match=r"reward\.fn"):
        omegaconf.OmegaConf.to_object(omegaconf.OmegaConf.merge(cfg, {"fn": "nocolon"}))


# ---------------------------------------------------------------------------------------------- converter


@pytest.fixture(scope="module")
def convert_gsm8k():
    path = REPO / "scripts" / "convert_gsm8k.py"
    spec = importlib.util.spec_from_file_location("convert_gsm8k", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 friends ...?", "answer": GSM8K_SOLUTION},
    {"question": "How much is a big number?", "answer": "It is big.\n#### 1,000"},
    {"question": "No marker?", "answer": "72"},
    {"question": "", "answer": "#### 3"},
    ["not", "an", "object"],
]


def _write_gsm8k(path: Path) -> None:
    lines = [json.dumps(r) for r in GSM8K_ROWS] + ["{broken json", ""]
    path.write_text("\n".join(lines) + "\n")


def test_convert_gsm8k(tmp_path: Path, convert_gsm8k, capsys: pytest.CaptureFixture) -> None:
    src, dst = tmp_path / "train.jsonl", tmp_path / "data" / "gsm8k_train.jsonl"
    _write_gsm8k(src)
    assert convert_gsm8k.main(["--input", str(src), "--output", str(dst)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows_written"] == 2 and summary["rows_skipped"] == 4
    assert summary["skipped"]["'answer' has no '####' marker"] == {"count": 1, "first_row": 3}
    assert set(summary["skipped"]) >= {"missing or empty 'question'", "not a JSON object"}
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert rows[0]["prompt"].endswith('Let\'s think step by step and output the final answer after "####".')
    assert rows[0]["prompt"].startswith("Natalia sold clips")
    assert [r["answer"] for r in rows] == ["72", "1000"]
    assert rows[0]["solution"] == GSM8K_SOLUTION
    # the converted rows score 1.0 against the original solution's final answer
    assert math_reward(RewardInput("p", "#### 72", rows[0], "stop")) == 1.0


def test_convert_gsm8k_never_loses_data(tmp_path: Path, convert_gsm8k, capsys: pytest.CaptureFixture) -> None:
    src, dst = tmp_path / "train.jsonl", tmp_path / "out.jsonl"
    _write_gsm8k(src)
    dst.write_text("precious\n")
    assert convert_gsm8k.main(["--input", str(src), "--output", str(dst)]) == 2
    assert "--force" in capsys.readouterr().err and dst.read_text() == "precious\n"
    assert convert_gsm8k.main(["--input", str(src), "--output", str(src), "--force"]) == 2
    assert "is the input" in capsys.readouterr().err
    assert convert_gsm8k.main(["--input", str(src), "--output", str(dst), "--force", "--instruction", ""]) == 0
    assert json.loads(dst.read_text().splitlines()[0])["prompt"] == GSM8K_ROWS[0]["question"]
    bad, out2 = tmp_path / "bad.jsonl", tmp_path / "out2.jsonl"
    bad.write_text('{"question": "q", "answer": "no marker"}\n')
    assert convert_gsm8k.main(["--input", str(bad), "--output", str(out2)]) == 2
    assert not out2.exists() and not list(tmp_path.glob(".out2*"))  # no partial or temp file left
    assert convert_gsm8k.main(["--input", str(tmp_path / "missing.jsonl"), "--output", str(out2)]) == 2


def test_convert_gsm8k_parquet(tmp_path: Path, convert_gsm8k, capsys: pytest.CaptureFixture) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    src, dst = tmp_path / "test-00000-of-00001.parquet", tmp_path / "test.jsonl"
    pq.write_table(pa.table({"question": ["Q1?"], "answer": ["x\n#### -3"]}), src)
    assert convert_gsm8k.main(["--input", str(src), "--output", str(dst)]) == 0
    assert json.loads(dst.read_text())["answer"] == "-3"
    pq.write_table(pa.table({"q": ["Q1?"]}), src)
    assert convert_gsm8k.main(["--input", str(src), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "lacks column(s) ['answer', 'question']" in capsys.readouterr().err
