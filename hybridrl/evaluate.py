"""Score a model on a data set: `python -m hybridrl.evaluate model.path=... data=... reward=...`.

    python -m hybridrl.evaluate model.path=outputs/<date>/<time>/checkpoints/step_000150      # a run's final model
    python -m hybridrl.evaluate model.path=Qwen/Qwen2.5-0.5B-Instruct data=hf data.path=openai/gsm8k \\
        data.config=main data.split=test reward=math eval.n=8 eval.temperature=1.0 engine.max_new_tokens=512

The same config groups as training (model, data, reward, engine, cluster, recipe) plus `eval.*`
(`hybridrl.eval_config.EvalConfig`). `model.path` takes a model folder, a Hub id or a checkpoint folder (verified
first). Every prompt of the chosen split gets `eval.n` answers through the run's own engine and worker group, scored
by the run's reward. Written to the run dir (`outputs/eval/<date>/<time>/`): `eval_samples.jsonl` (every sample:
prompt, response, answer, reward and its components, correct, length, finish reason) and `eval_summary.json`
(pass@k, reward/mean, reward/<component>, response lengths, what was evaluated); the console shows the table.
Greedy (the default) on the held-out prompts gives exactly the run's validation figures (`val/accuracy`,
`val/reward_mean`) for the same model.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hybridrl.cli import run_app
from hybridrl.config import validate
from hybridrl.config_checks import check_composed
from hybridrl.errors import ConfigError, HybridRLError, in_phase, phase_of
from hybridrl.eval_config import register_eval_configs

log = logging.getLogger("hybridrl")
T = TypeVar("T")

register_eval_configs()

SAMPLES_FILE = "eval_samples.jsonl"
SUMMARY_FILE = "eval_summary.json"


def guarded(body: Callable[[], T], run_dir: str) -> T:
    """`body()`; a user error ends the process with one line and exit code 2, Ctrl-C with 130, anything else with
    1 and one line naming the phase (the traceback goes to the run dir's log), as in training."""
    from hybridrl.app import crash_line, log_traceback

    try:
        return body()
    except HybridRLError as e:
        log.error("error: %s", e)
        sys.exit(2)
    except KeyboardInterrupt as e:
        log.error("interrupted%s", f" during {phase_of(e)}" if phase_of(e) else "")
        sys.exit(130)
    except Exception as e:  # a bug or a library's crash
        log.error("%s", crash_line(e, log_traceback(e, run_dir)))
        sys.exit(1)


def prepare(cfg: DictConfig):
    """The validated config, the workers' run config, the checkpoint to load, the model folder and its tokenizer."""
    from hybridrl.eval_policy import policy_config
    from hybridrl.models.loading import check_supported_architecture, load_tokenizer, resolve_model_path

    check_composed(cfg)
    app_cfg = validate(cfg)
    run_cfg, checkpoint = policy_config(app_cfg)
    model_path = resolve_model_path(run_cfg.model)
    check_supported_architecture(model_path, run_cfg.model.trust_remote_code)
    return app_cfg, run_cfg, checkpoint, model_path, load_tokenizer(model_path, run_cfg.model.trust_remote_code)


def eval_prompts(cfg, tokenizer) -> tuple[list, str]:
    """The prompts `eval.split` selects (first `eval.max_prompts`), and the split's name."""
    from hybridrl.data.prompts import load_prompts

    train, val = load_prompts(cfg.data, tokenizer)
    split = cfg.eval.split
    if split == "auto":
        split = "val" if val else "train"
    if split == "val" and not val:
        raise ConfigError(
            "eval.split=val, but the data has no held-out prompts: set data.val_path (data=jsonl) or data.val_split "
            "(data=hf), or score the training prompts with eval.split=train"
        )
    prompts = val if split == "val" else train
    return (prompts[: cfg.eval.max_prompts] if cfg.eval.max_prompts else prompts), split


def evaluate(cfg: DictConfig, run_dir: str) -> dict[str, Any]:
    """Generate and score; write the samples and the summary into `run_dir`; return the summary."""
    from hybridrl.eval_policy import policy_group, sampling
    from hybridrl.rewards.scoring import response_length
    from hybridrl.rollout.scoring import correct_flags, generate_and_score
    from hybridrl.tracking.eval_metrics import eval_figures, figures_table
    from hybridrl.tracking.samples import sample_rows

    with in_phase("config"):
        app_cfg, run_cfg, checkpoint, model_path, tokenizer = prepare(cfg)
        prompts, split = eval_prompts(app_cfg, tokenizer)
        params = sampling(app_cfg)
    log.info("evaluating %s on %d %s prompts x %d samples", checkpoint or model_path, len(prompts), split, params.n)
    with in_phase("setup"), policy_group(run_cfg, checkpoint) as group:
        with in_phase("generate"):
            batch, scores = generate_and_score(group, prompts, params, 0, agent=run_cfg.rollout.name == "agent")
    correct = correct_flags(scores.scores, scores.extras)
    lengths = [response_length(batch, i) for i in range(len(batch))]
    figures = eval_figures(params.n, scores.scores, scores.extras, correct, lengths, batch.meta["finish_reason"])
    if scores.errors:
        figures["reward/errors"] = scores.errors
    rows = sample_rows(batch, list(range(len(batch))), tokenizer, scores.scores, scores.extras)
    with open(Path(run_dir) / SAMPLES_FILE, "w") as f:
        for i, row in enumerate(rows):
            extra = {"prompt_index": i // params.n, "sample": i % params.n, "correct": correct[i], "length": lengths[i]}
            f.write(json.dumps({**extra, **row}, ensure_ascii=False) + "\n")
    summary = {
        "model": str(model_path),
        "checkpoint": str(checkpoint) if checkpoint else None,
        "data": run_cfg.data.name,
        "data_path": run_cfg.data.path,
        "split": split,
        "reward": run_cfg.reward.spec,
        "engine": run_cfg.engine.name,
        "n": params.n,
        "temperature": params.temperature,
        "max_new_tokens": params.max_new_tokens,
        **figures,
    }
    (Path(run_dir) / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    how = "greedy" if params.temperature == 0 else f"temperature {params.temperature}"
    log.info(
        "%d %s prompts x %d samples (%s), engine=%s:\n%s\nsamples: %s; summary: %s",
        len(prompts),
        split,
        params.n,
        how,
        run_cfg.engine.name,
        figures_table(figures),
        os.path.relpath(Path(run_dir) / SAMPLES_FILE),
        os.path.relpath(Path(run_dir) / SUMMARY_FILE),
    )
    return summary


@hydra.main(version_base="1.3", config_path="pkg://hybridrl.conf", config_name="evaluate")
def _hydra_entry(cfg: DictConfig) -> float:
    run_dir = HydraConfig.get().runtime.output_dir
    summary = guarded(lambda: evaluate(cfg, run_dir), run_dir)
    return summary["pass@1"]  # what a sweep over eval.* compares


def main() -> None:
    """Console entry point: `python -m hybridrl.evaluate [overrides]`."""
    run_app(_hydra_entry, "hybridrl.evaluate")


if __name__ == "__main__":
    main()
