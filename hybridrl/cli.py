"""What the command-line apps share around Hydra: `--help`, and one-line errors for a bad command line.

    python -m hybridrl --help            # the config groups with their options, and where every key is explained
    python -m hybridrl.evaluate --help
    python -m hybridrl.generate --help
    python -m hybridrl.plan --help

Hydra's own help lists neither the `recipe` group (it lives on a search path) nor what any key means; ours lists
every group and points to docs/reference.md (generated from the dataclasses' docstrings). `--hydra-help` is Hydra's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from hybridrl.config_checks import composition_error_line, moved_key_in_overrides

REFERENCE = "docs/reference.md"

USAGE = {
    "hybridrl": (
        "python -m hybridrl [group=option ...] [key=value ...]",
        "Train a policy with RL (GRPO/PPO family); the default run is a tiny model on a synthetic task, on CPU.",
        [
            "python -m hybridrl recipe=cpu_demo",
            "python -m hybridrl model=hf model.path=Qwen/Qwen2.5-0.5B-Instruct data=hf data.path=openai/gsm8k \\\n"
            "      data.config=main data.val_split=test reward=math trainer.lr=1e-6 engine.max_new_tokens=512",
            "python -m hybridrl -m trainer.lr=1e-3,3e-3          # a sweep: one run per value (-m = --multirun)",
        ],
    ),
    "hybridrl.evaluate": (
        "python -m hybridrl.evaluate model.path=<model folder | Hub id | checkpoints/step_N> [key=value ...]",
        "Score a model on a data set: pass@k, mean reward and its components, response length (docs/evaluate.md).",
        [
            "python -m hybridrl.evaluate model.path=outputs/<date>/<time>/checkpoints/step_000150",
            "python -m hybridrl.evaluate model.path=Qwen/Qwen2.5-0.5B-Instruct data=hf data.path=openai/gsm8k \\\n"
            "      data.config=main data.split=test reward=math eval.n=8 eval.temperature=1.0",
        ],
    ),
    "hybridrl.generate": (
        "python -m hybridrl.generate model.path=<model folder | Hub id | checkpoints/step_N> 'prompts=[...]'",
        "Print completions of a few prompts (docs/evaluate.md).",
        ['python -m hybridrl.generate \'prompts=["copy: 4172", "copy: 93"]\' eval.n=2 eval.temperature=1.0'],
    ),
    "hybridrl.plan": (
        "python -m hybridrl.plan [group=option ...] [key=value ...]   (the run's own overrides)",
        "Estimate each phase's peak device memory before any weights load; exit 0 if the run fits, 2 if not, with "
        "the settings that would fit (docs/running.md).",
        [
            "python -m hybridrl.plan model=hf model.path=Qwen/Qwen2.5-7B-Instruct trainer.device=cuda "
            "trainer.device_memory_gb=139.8",
        ],
    ),
}


def wants_help(argv: list[str]) -> bool:
    """`--help` or `-h` among the arguments."""
    return any(a in ("--help", "-h") for a in argv)


def help_text(app: str) -> str:
    """The app's help: usage, examples, every config group with its options and meaning, where keys are explained."""
    import dataclasses

    from hybridrl.config import RunConfig
    from hybridrl.config_reference import field_docs, group_options

    usage, what, examples = USAGE[app]
    docs = field_docs(RunConfig)
    groups = group_options()
    docs["recipe"] = "Experiment presets (recipes/recipe/*.yaml; each starts with its command and expected result)."
    width = max(len(g) for g in groups)
    lines = [f"usage: {usage}", "", what, "", "examples:"]
    lines += [f"  {e}" for e in examples]
    lines += ["", "config groups (group=option):"]
    for group, options in groups.items():
        lines.append(f"  {group:<{width}}  {', '.join(options)}")
        if docs.get(group):
            lines.append(f"  {'':<{width}}  {docs[group]}")
    sections = [f.name for f in dataclasses.fields(RunConfig) if f.name not in groups]
    lines += ["", f"sections set by key only: {', '.join(sections)}"]
    lines += [
        "",
        f"Every key, its type, default and meaning: {REFERENCE} (python -m hybridrl.config_reference writes it).",
        f"The composed config: python -m {app} --cfg job [overrides]. key=value sets a key, group=option picks an",
        "option, +key=value adds a key a free-form section allows; -m (--multirun) runs a sweep (key=a,b). Hydra's",
        "own flags: --hydra-help.",
    ]
    return "\n".join(lines)


def run_app(entry: Callable[[], object], app: str) -> None:
    """Run a Hydra `entry` as a console app: `--help` prints ours; a moved key on the command line, and Hydra's
    composition errors, end with one line and exit code 2 (HYDRA_FULL_ERROR=1 shows Hydra's whole error)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    argv = sys.argv[1:]
    if wants_help(argv):
        print(help_text(app))
        sys.exit(0)
    moved = moved_key_in_overrides(argv)
    if moved:
        print(f"error: {moved}", file=sys.stderr)
        sys.exit(2)
    user_full = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing; we print one line below
    try:
        entry()
    except (HydraException, OmegaConfBaseException) as e:
        if user_full:
            raise
        print(f"error: {composition_error_line(e)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        if not user_full:
            os.environ.pop("HYDRA_FULL_ERROR", None)
