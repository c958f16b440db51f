"""Every command printed in the README, the docs, benchmarks/RESULTS.md, CONTRIBUTING.md and the recipe headers runs
as printed, as far as it can be checked without running it.

Each command is read as a user would copy it: continuation lines ending in `\\` joined, an environment prefix
(`WANDB_MODE=offline`) and a trailing `# comment` dropped, shell quoting undone. A `python -m hybridrl ...` command's
overrides then go through Hydra's override parser and compose API with the repo's config validation, so a value
Hydra cannot parse on a command line (`trainer.offload=params,optimizer` outside -m), an unknown key or a bad value
fails here. Sweeps (`-m`) are expanded value by value (an Optuna `interval(a,b)` by its lower end). A
`python -m hybridrl.export`, `python -m benchmarks.<name>` or `python scripts/<name>.py` command's arguments go
through that program's own argument parser, so an option that does not exist (or no longer does) fails here.
Placeholder paths such as `/path/to/model` are fine: nothing opens them.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import re
import shlex
import sys

import pytest

from tests.paths import REPO

README = REPO / "README.md"
# Markdown files whose commands users copy: the README first, then the docs pages and the other guides.
DOCS = [
    README,
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "benchmarks" / "RESULTS.md",
    REPO / "CONTRIBUTING.md",
    REPO / "recipes" / "README.md",
]
RECIPES = sorted((REPO / "recipes" / "recipe").glob("*.yaml"))

# `python -m hybridrl.evaluate` / `.generate` compose other configs: docs/evaluate.md's commands are checked by
# tests/unit/test_eval_commands.py.
_PREFIX = r"(?:^|(?<=[\s;&|(`]))(?:[\w.~/-]*/)?python3?\s+"
_CMD_RE = re.compile(_PREFIX + r"-m\s+hybridrl(?![\w.])(?P<args>.*)$")
# The package's other commands, the benchmarks and the scripts: (module or script path, arguments).
_TOOL_RE = re.compile(
    _PREFIX + r"(?:-m\s+(?P<module>hybridrl\.export|benchmarks\.\w+)|(?P<script>scripts/\w+\.py))(?P<args>.*)$"
)
_INLINE_RE = re.compile(r"`([^`\n]+)`")
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-dir", "-cd"}
_FLAGS = {"--resolve", "--info", "-i", "--help", "-h", "--hydra-help"}
MAX_SWEEP_JOBS = 4


def _joined_lines(lines: list[str]) -> list[str]:
    """Lines with `\\`-continuations joined into one."""
    out: list[str] = []
    pending = ""
    for line in lines:
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append(pending + stripped)
        pending = ""
    if pending:
        out.append(pending)
    return out


def _markdown_command_lines(text: str) -> list[str]:
    """The lines a command can be copied from: each line of a fenced code block (continuations joined) and each
    inline code span of the prose."""
    lines: list[str] = []
    fenced, block, prose = False, [], []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if fenced:
                lines += _joined_lines(block)
                block = []
            fenced = not fenced
            continue
        (block if fenced else prose).append(line)
    return lines + _INLINE_RE.findall("\n".join(prose))


def readme_commands(text: str) -> list[str]:
    """The argument strings of every `python -m hybridrl` command in a markdown text: in fenced code blocks
    (whole lines) and in inline code spans of the prose."""
    return _commands_in(_markdown_command_lines(text))


def tool_commands(text: str) -> list[tuple[str, str]]:
    """(module, arguments) of every `python -m hybridrl.export`, `python -m benchmarks.<name>` and
    `python scripts/<name>.py` command in a markdown text; a script is named by its module (`scripts.<name>`)."""
    found = []
    for line in _markdown_command_lines(text):
        m = _TOOL_RE.search(line)
        if m:
            module = m.group("module") or m.group("script")[: -len(".py")].replace("/", ".")
            found.append((module, m.group("args").strip()))
    return found


def recipe_commands(text: str) -> list[str]:
    """The commands in a recipe's leading comment block."""
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        header.append(line[1:])
    return _commands_in(_joined_lines(header))


def _commands_in(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        m = _CMD_RE.search(line)
        if m:
            out.append(m.group("args").strip())
    return out


def words_of(args: str) -> list[str]:
    """The words a shell passes to the program: quoting undone, up to the first shell operator (`&& echo done`:
    the next shell command is not ours) or comment."""
    lexer = shlex.shlex(args, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True  # words end at spaces and shell operators; "# ..." is a comment
    words = []
    for tok in lexer:
        if tok and set(tok) <= set(";&|"):
            break
        words.append(tok)
    return words


def overrides_of(args: str) -> tuple[list[str], bool]:
    """(overrides, multirun) of one command's arguments; Hydra's own flags are dropped."""
    overrides, multirun, skip = [], False, False
    for tok in words_of(args):
        if skip:
            skip = False
        elif tok in ("-m", "--multirun"):
            multirun = True
        elif tok in _FLAGS_WITH_VALUE:
            skip = True
        elif tok in _FLAGS or tok.startswith("--"):
            continue
        else:
            overrides.append(tok)
    return overrides, multirun


def expand(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists of the jobs a command runs (one without -m; each sweep combination with it).

    Raises ValueError when a sweep appears without -m (Hydra refuses it too)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices: list[list[str]] = []
    for text, o in zip(overrides, parsed):
        if not o.is_sweep_override():
            choices.append([text])
            continue
        if not multirun:
            raise ValueError(
                f"{text!r} is a sweep (Hydra reads the comma as a list of runs); without -m it does not run"
            )
        key = o.get_key_element()
        if isinstance(o.value(), IntervalSweep):
            values = [str(o.value().start)]
        else:
            values = list(o.sweep_string_iterator())
        choices.append([f"{key}={v}" for v in values])
    return [list(c) for c in itertools.islice(itertools.product(*choices), MAX_SWEEP_JOBS)]


def compose_and_validate(overrides: list[str]) -> None:
    from hydra import compose, initialize_config_module

    from hybridrl.config import register_configs, validate

    register_configs()
    with initialize_config_module(config_module="hybridrl.conf", version_base="1.3"):
        validate(compose(config_name="config", overrides=overrides))


def _relative(path) -> str:
    return path.relative_to(REPO).as_posix()


def _all_commands() -> list[tuple[str, str]]:
    cases = [(_relative(doc), args) for doc in DOCS for args in readme_commands(doc.read_text())]
    for path in RECIPES:
        cases += [(f"recipes/recipe/{path.name}", args) for args in recipe_commands(path.read_text())]
    return cases


COMMANDS = _all_commands()
TOOL_COMMANDS = [(_relative(doc), module, args) for doc in DOCS for module, args in tool_commands(doc.read_text())]


def test_the_docs_have_commands_to_check() -> None:
    sources = {src for src, _ in COMMANDS}
    assert "README.md" in sources and len(COMMANDS) >= 10
    pages = {"docs/configuration.md", "docs/running.md", "docs/agents.md", "docs/engines.md", "docs/ppo.md"}
    assert pages <= sources, f"pages without a python -m hybridrl command: {sorted(pages - sources)}"
    assert {f"recipes/recipe/{p.name}" for p in RECIPES} <= sources, "every recipe header gives its command"
    assert {"benchmarks/RESULTS.md", "CONTRIBUTING.md"} <= {src for src, _, _ in TOOL_COMMANDS}


@pytest.mark.parametrize("source,args", COMMANDS, ids=[f"{s}: {a[:60]}" for s, a in COMMANDS])
def test_command_composes_as_printed(source: str, args: str) -> None:
    overrides, multirun = overrides_of(args)
    try:
        jobs = expand(overrides, multirun)
        for job in jobs:
            compose_and_validate(job)
    except Exception as e:  # noqa: BLE001 - report which printed command broke, and how
        pytest.fail(f"{source}: `python -m hybridrl {args}` does not run as printed: {type(e).__name__}: {e}")


class _Parsed(Exception):
    """Raised by the patched parser once a program's arguments parse, so the program stops before it runs."""


def parse_like_the_program(module_name: str, words: list[str], monkeypatch) -> argparse.Namespace:
    """Run `module_name`'s `main()` with `words` as its command line until its argument parser has parsed them;
    argparse's own error (SystemExit) propagates for arguments the program does not accept."""
    real_parse_args = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(real_parse_args(self, args, namespace))

    module = importlib.import_module(module_name)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [module_name, *words])
    try:
        module.main()
    except _Parsed as parsed:
        return parsed.args[0]
    raise AssertionError(f"{module_name}.main() returned without parsing its arguments")


@pytest.mark.parametrize("source,module,args", TOOL_COMMANDS, ids=[f"{s}: {m} {a[:50]}" for s, m, a in TOOL_COMMANDS])
def test_program_command_parses_as_printed(source: str, module: str, args: str, monkeypatch, capsys) -> None:
    try:
        parse_like_the_program(module, words_of(args), monkeypatch)
    except SystemExit:
        printed = module if module.startswith(("hybridrl", "benchmarks")) else module.replace(".", "/") + ".py"
        pytest.fail(f"{source}: `python {printed} {args}` is refused: {capsys.readouterr().err.strip()}")


# ---- the extractor itself, on made-up text with the shapes the docs use ----------------------------------------


def test_extraction_joins_continuations_and_drops_prefixes_comments_and_other_commands() -> None:
    text = (
        "Run `python -m hybridrl trainer.steps=2` or:\n\n"
        "```bash\n"
        "WANDB_MODE=offline python -m hybridrl logger=wandb   # offline\n"
        "python -m hybridrl model=hf model.path=/path/to/m \\\n"
        "    data=jsonl data.path=/p.jsonl\n"
        "pip install -e . && python -m hybridrl --cfg job && echo done\n"
        "python scripts/summarize_sweep.py multirun/x\n"
        ".venv-vllm/bin/python -m hybridrl engine=vllm\n"
        "```\n"
    )
    assert [overrides_of(c) for c in readme_commands(text)] == [
        (["logger=wandb"], False),
        (["model=hf", "model.path=/path/to/m", "data=jsonl", "data.path=/p.jsonl"], False),
        ([], False),
        (["engine=vllm"], False),
        (["trainer.steps=2"], False),
    ]
    assert overrides_of("data.synthetic.task=sort   # copy | reverse | sort | add") == (
        ["data.synthetic.task=sort"],
        False,
    )
    assert overrides_of("a=1 | tee log") == (["a=1"], False)
    assert overrides_of("-m --cfg job 'trainer.lr=interval(1e-4,1e-2)'") == (["trainer.lr=interval(1e-4,1e-2)"], True)
    assert tool_commands(text) == [("scripts.summarize_sweep", "multirun/x")]
    assert tool_commands(
        "`python -m hybridrl.export --checkpoint c --output o`, `python -m benchmarks.step --shape 1.5b`"
    ) == [
        ("hybridrl.export", "--checkpoint c --output o"),
        ("benchmarks.step", "--shape 1.5b"),
    ]
    header = "# @package _global_\n# Demo.\n#\n#   python -m hybridrl recipe=x \\\n#       a.b=1\nfoo: 1\n"
    assert [c.split() for c in recipe_commands(header)] == [["recipe=x", "a.b=1"]]


def test_a_program_option_that_does_not_exist_is_refused(monkeypatch) -> None:
    words = words_of("--output /tmp/x.jsonl --n 5   # five tasks")
    assert parse_like_the_program("scripts.make_countdown", words, monkeypatch).n == 5
    with pytest.raises(SystemExit):
        parse_like_the_program("scripts.make_countdown", [*words, "--count", "5"], monkeypatch)


def test_expansion_runs_each_sweep_value_and_refuses_a_sweep_without_multirun() -> None:
    assert expand(["trainer.lr=1e-5,3e-5", "logger=wandb"], multirun=True) == [
        ["trainer.lr=1e-05", "logger=wandb"],
        ["trainer.lr=3e-05", "logger=wandb"],
    ]
    assert expand(["trainer.lr=interval(1e-4,1e-2)"], multirun=True) == [["trainer.lr=0.0001"]]
    with pytest.raises(ValueError, match="trainer.offload=params,optimizer"):
        expand(["trainer.offload=params,optimizer"], multirun=False)


@pytest.mark.parametrize(
    "override,parts",
    [
        ("trainer.offload=[params,optimizer]", {"params", "optimizer"}),
        ("trainer.offload=params", {"params"}),
        ("trainer.offload=none", set()),
        ("trainer.offload=[]", set()),
        ("trainer.offload=[optimizer,optimizer]", {"optimizer"}),
    ],
)
def test_offload_accepts_hydras_list_form_and_plain_names(override: str, parts: set[str]) -> None:
    from hydra import compose, initialize_config_module

    from hybridrl.config import register_configs, validate

    register_configs()
    with initialize_config_module(config_module="hybridrl.conf", version_base="1.3"):
        assert validate(compose(config_name="config", overrides=[override])).trainer.offload_parts() == parts


@pytest.mark.parametrize(
    "override", ["trainer.offload=[params,gradients]", "trainer.offload=gradients", "trainer.offload=3"]
)
def test_offload_names_the_key_for_an_unknown_part(override: str) -> None:
    from hybridrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"trainer\.offload"):
        compose_and_validate([override])


# ---- single overrides quoted inline in the prose (`trainer.offload=...`) ------------------------------------------

_GROUPS = ("model", "engine", "trainer", "algorithm", "data", "reward", "logger", "cluster", "reshard", "recipe")
_OVERRIDE_SPAN_RE = re.compile(rf"^(?:{'|'.join(_GROUPS)})[\w.]*=\S+$")
# Printed in the docs and not runnable as printed, while a fix is pending (then this list empties).
AWAITING_README_FIX: set[str] = set()


def readme_inline_overrides(text: str) -> list[str]:
    """Inline code spans of the prose that are one override (`trainer.resume=auto`)."""
    prose, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            prose.append(line)
    spans = {s for s in _INLINE_RE.findall("\n".join(prose)) if _OVERRIDE_SPAN_RE.match(s)}
    return sorted(s for s in spans if "<" not in s)  # `recipe=<name>` is a pattern, not a value


INLINE = sorted({span for doc in DOCS for span in readme_inline_overrides(doc.read_text())})


@pytest.mark.parametrize(
    "span",
    [
        pytest.param(s, marks=pytest.mark.xfail(strict=True, reason="README fix pending"))
        if s in AWAITING_README_FIX
        else s
        for s in INLINE
    ],
)
def test_inline_override_parses_as_one_value(span: str) -> None:
    # Placeholders (`trainer.save_every=N`) cannot compose, but every span must parse, and not as a sweep.
    overrides, _ = overrides_of(shlex.quote(span))
    expand(overrides, multirun=False)
