"""Write a Hugging Face model folder (safetensors + config + tokenizer) from a hybridrl checkpoint.

    python tools/export_hf.py --checkpoint outputs/run/checkpoints/step_000060 --output exported/

A LoRA checkpoint (`model.lora`) is written as a PEFT adapter folder (adapter_config.json,
adapter_model.safetensors: load it with `PeftModel.from_pretrained(base, folder)`), or with `--merge` as the full
model with the adapters merged in.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch


def export(checkpoint: Path, output: Path, force: bool = False, merge: bool = False) -> Path:
    """Load the checkpoint's policy weights into the base model and save it with its tokenizer (a LoRA checkpoint:
    the adapter folder, or the merged model with `merge`)."""
    from omegaconf import OmegaConf

    from hybridrl.config import RunConfig
    from hybridrl.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
    from hybridrl.training.checkpoint import load_model_weights

    meta = json.loads((checkpoint / "meta.json").read_text())
    cfg: RunConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), meta["config"]))
    base = resolve_model_path(cfg.model)
    model = load_causal_lm(base, cfg.model, torch.float32, "cpu")
    if cfg.model.lora.enabled:
        from hybridrl.training.lora import export_model

        model = export_model(model, cfg.model.lora, checkpoint, merge)
    else:
        load_model_weights(checkpoint, model)
    if output.exists():
        if not force:
            raise SystemExit(f"error: {output} exists; pass --force to replace it")
        shutil.rmtree(output)
    tmp = output.with_name(f".tmp-{output.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(base, cfg.model.trust_remote_code).save_pretrained(tmp)
    os.replace(tmp, output)  # only a complete folder ever appears under the output name
    return output


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, type=Path, help="a checkpoints/step_N folder")
    ap.add_argument("--output", required=True, type=Path, help="folder to write the HF model into")
    ap.add_argument("--force", action="store_true", help="replace an existing output folder")
    ap.add_argument("--merge", action="store_true",
                    help="LoRA checkpoint: write the merged model instead of the adapter folder (no effect otherwise)")
    args = ap.parse_args(argv)
    if not (args.checkpoint / "meta.json").is_file():
        print(f"error: {args.checkpoint} is not a complete checkpoint (no meta.json)", file=sys.stderr)
        return 2
    out = export(args.checkpoint, args.output, args.force, args.merge)
    print(json.dumps({"output": str(out), "files": sorted(p.name for p in out.iterdir())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
