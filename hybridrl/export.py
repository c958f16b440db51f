"""Write a Hugging Face model folder (safetensors + config + tokenizer) from a hybridrl checkpoint.

    python -m hybridrl.export --checkpoint outputs/run/checkpoints/step_000060 --output exported/
    python -m hybridrl.export --checkpoint ... --output ... --model-path /models/Qwen2.5-0.5B-Instruct
    python -m hybridrl.export --checkpoint ... --output ... --merge       # a LoRA run: the merged model

It prints where the folder is and the lines that load it (`--json`: {output, files} for scripts). A run saves its
final model by default (`trainer.save_final`), so `outputs/<date>/<time>/checkpoints/step_<last>` is always there.

A LoRA checkpoint (`model.lora`) is written as a PEFT adapter folder (adapter_config.json,
adapter_model.safetensors: load it with `PeftModel.from_pretrained(base, folder)`), or with `--merge` as the full
model with the adapters merged in. The checkpoint is verified against its checksums first. The base model folder and
whether its code may run (`--trust-remote-code`) come from the command line only, never from the checkpoint's
metadata: a checkpoint someone hands you must not choose which code runs on your machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch


def model_config(meta: dict, model_path: str | None, trust_remote_code: bool):
    """The checkpoint's model section, with the path and the remote-code switch the user gave.

    Raises SystemExit when the checkpoint names a model folder or remote code the user did not pass.
    """
    from omegaconf import OmegaConf

    from hybridrl.models.config import ModelConfig

    saved = dict((meta.get("config") or {}).get("model") or {})
    if saved.get("path") and not model_path:
        raise SystemExit(
            f"error: the checkpoint was trained from model.path={saved['path']!r}; pass --model-path with that "
            "folder (or one with the same architecture and tokenizer): the model folder is never taken from "
            "a checkpoint's metadata"
        )
    if saved.get("trust_remote_code") and not trust_remote_code:
        raise SystemExit(
            "error: the checkpoint's config sets model.trust_remote_code=true; pass --trust-remote-code if you "
            "trust the code inside the model folder (it is never enabled from a checkpoint's metadata)"
        )
    saved.update(path=model_path, trust_remote_code=trust_remote_code, cache_dir=None)
    if model_path:
        saved["name"] = "hf"
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved))


def export(
    checkpoint: Path,
    output: Path,
    force: bool = False,
    model_path: str | None = None,
    trust_remote_code: bool = False,
    merge: bool = False,
) -> Path:
    """Load the checkpoint's policy weights into the base model and save it with its tokenizer (a LoRA checkpoint:
    the adapter folder, or the merged model with `merge`)."""
    from hybridrl.checkpoints import read_meta, verify
    from hybridrl.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
    from hybridrl.models.quiet import no_progress_bars
    from hybridrl.training.checkpoint import load_model_weights

    verify(checkpoint)
    cfg = model_config(read_meta(checkpoint), model_path, trust_remote_code)
    base = resolve_model_path(cfg)
    model = load_causal_lm(base, cfg, torch.float32, "cpu")
    with warnings.catch_warnings():
        # torch.distributed.checkpoint, read in one process on purpose, says it assumes so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        if cfg.lora.enabled:
            from hybridrl.training.lora import export_model

            model = export_model(model, cfg.lora, checkpoint, merge)
        else:
            load_model_weights(checkpoint, model)
    if output.exists():
        if not force:
            raise SystemExit(f"error: {output} exists; pass --force to replace it")
        shutil.rmtree(output)
    tmp = output.with_name(f".tmp-{output.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    with no_progress_bars():
        model.save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(base, cfg.trust_remote_code).save_pretrained(tmp)
    os.replace(tmp, output)  # only a complete folder ever appears under the output name
    return output


def main(argv: list[str] | None = None) -> int:
    from hybridrl.errors import HybridRLError

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, type=Path, help="a checkpoints/step_000150-style folder")
    ap.add_argument("--output", required=True, type=Path, help="folder to write the HF model into")
    ap.add_argument("--force", action="store_true", help="replace an existing output folder")
    ap.add_argument(
        "--model-path",
        default=None,
        help="the base model folder the run trained (model.path); needed unless the run used the tiny model",
    )
    ap.add_argument("--trust-remote-code", action="store_true", help="allow code shipped in the model folder to run")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="LoRA checkpoint: write the merged model instead of the adapter folder (no effect otherwise)",
    )
    ap.add_argument("--json", action="store_true", help="print {output, files} as JSON instead of how to load it")
    args = ap.parse_args(argv)
    if not (args.checkpoint / "meta.json").is_file():
        print(f"error: {args.checkpoint} is not a complete checkpoint (no meta.json)", file=sys.stderr)
        return 2
    try:
        out = export(args.checkpoint, args.output, args.force, args.model_path, args.trust_remote_code, args.merge)
    except HybridRLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in out.iterdir())
    if args.json:
        print(json.dumps({"output": str(out), "files": files}))
    else:
        print(how_to_load(out.resolve(), files, args.model_path))
    return 0


def how_to_load(folder: Path, files: list[str], base: str | None) -> str:
    """Where the export went and the lines that load it (an adapter folder needs its base model)."""
    head = f"wrote {folder} ({', '.join(files)})\nload it with:\n"
    if "adapter_config.json" in files:
        base = base or "<the tiny model's folder: the run's model.path>"
        return head + (
            "  from peft import PeftModel\n  from transformers import AutoModelForCausalLM\n"
            f'  model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), "{folder}")\n'
            "(or export again with --merge for a plain model folder)"
        )
    return head + (
        "  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f'  model = AutoModelForCausalLM.from_pretrained("{folder}")\n'
        f'  tokenizer = AutoTokenizer.from_pretrained("{folder}")\n'
        f"or score it: python -m hybridrl.evaluate model.path={folder}; train from it: "
        f"python -m hybridrl model=hf model.path={folder}"
    )


if __name__ == "__main__":
    sys.exit(main())
