"""Print a model's completions of a few prompts: `python -m hybridrl.generate model.path=... 'prompts=[...]'`.

    python -m hybridrl.generate model.path=outputs/<date>/<time>/checkpoints/step_000150 'prompts=["copy: 4172"]'
    python -m hybridrl.generate model.path=Qwen/Qwen2.5-0.5B-Instruct 'prompts=["What is 17*23?"]' \\
        eval.n=2 eval.temperature=0.7 engine.max_new_tokens=128

`model.path` takes a model folder, a Hub id or a checkpoint folder, as `python -m hybridrl.evaluate` does; each prompt
is rendered like training data (the chat template, `data.system_prompt`; raw text with
`data.apply_chat_template=false`) and gets `eval.n` completions (greedy by default) through the run's engine. The
completions are printed and written to `generations.jsonl` in the run dir (`outputs/generate/<date>/<time>/`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hybridrl.cli import run_app
from hybridrl.errors import in_phase
from hybridrl.eval_config import register_eval_configs
from hybridrl.evaluate import guarded, prepare

log = logging.getLogger("hybridrl")

register_eval_configs()

OUTPUT_FILE = "generations.jsonl"


def generate(cfg: DictConfig, run_dir: str) -> list[dict]:
    """Completions of `cfg.prompts`, printed and written to `run_dir`; returns one row per completion."""
    from hybridrl.data.prompts import Prompt, check_prompt, render_prompt
    from hybridrl.eval_policy import policy_group, sampling
    from hybridrl.rewards.scoring import response_text
    from hybridrl.rollout.scoring import rollout_batch

    with in_phase("config"):
        app_cfg, run_cfg, checkpoint, model_path, tokenizer = prepare(cfg)
        params = sampling(app_cfg)
        prompts = []
        for i, raw in enumerate(app_cfg.prompts):
            check_prompt(raw, f"prompts[{i}]", "prompts")
            text = render_prompt(raw, tokenizer, run_cfg.data, f"prompts[{i}]")
            prompts.append(Prompt(tokenizer(text, add_special_tokens=False)["input_ids"], text, {"prompt": raw}))
    with in_phase("setup"), policy_group(run_cfg, checkpoint) as group:
        with in_phase("generate"):
            outs = group.generate([p.token_ids for p in prompts], 0, params)
    batch, _ = rollout_batch(prompts, outs, agent=run_cfg.rollout.name == "agent")  # agent: the whole trajectory
    rows = [
        {
            "prompt": app_cfg.prompts[o.prompt_index],
            "completion": response_text(batch, i, tokenizer),
            "finish_reason": batch.meta["finish_reason"][i],
        }
        for i, o in enumerate(outs)
    ]
    with open(Path(run_dir) / OUTPUT_FILE, "w") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    lines = []
    for i, prompt in enumerate(app_cfg.prompts):
        lines.append(f"prompt {i}: {prompt}")
        mine = [r for r, c in zip(rows, outs) if c.prompt_index == i]
        for j, r in enumerate(mine):
            cut = " [cut at max_new_tokens]" if r["finish_reason"] == "length" else ""
            lines.append(f"  [{j}] {r['completion']}{cut}")
    log.info("%s:\n%s", checkpoint or model_path, "\n".join(lines))
    return rows


@hydra.main(version_base="1.3", config_path="pkg://hybridrl.conf", config_name="generate")
def _hydra_entry(cfg: DictConfig) -> None:
    run_dir = HydraConfig.get().runtime.output_dir
    guarded(lambda: generate(cfg, run_dir), run_dir)


def main() -> None:
    """Console entry point: `python -m hybridrl.generate [overrides]`."""
    run_app(_hydra_entry, "hybridrl.generate")


if __name__ == "__main__":
    main()
