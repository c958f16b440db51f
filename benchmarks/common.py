"""What the benchmarks share: a random-init model folder of a real shape, the run config they measure, the product's
own builders (a benchmark measures exactly what a run executes), and their command-line and JSON conventions.

    cfg = bench_config(model_dir, device, ["trainer.offload=[params,optimizer]", "engine.max_new_tokens=512"])
    controller = bench_controller(cfg, prompts)    # a GRPO step is controller.train_step(step), as in a run
    roles = bench_worker(cfg, device)              # or one device's roles, to time their lifecycle calls
    rollout = bench_rollout(cfg, roles)            # another engine for the same actor, built as a run builds it

Every benchmark prints one JSON object on stdout (progress goes to stderr) and, with `--out FILE`, writes it there too.
Absolute times are labelled with the device (`device`, `gpu`); comparisons are ratios taken in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridrl.config import RunConfig, validate
from hybridrl.data.prompts import Prompt
from hybridrl.errors import ConfigError
from hybridrl.models.tiny import build_tokenizer

# Qwen2.5 shapes: (hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings).
SHAPES = {
    "tiny": (64, 2, 4, 2, 128, 1000, True),
    "0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "1.5b": (1536, 28, 12, 2, 8960, 151936, True),
    "7b": (3584, 28, 28, 4, 18944, 152064, False),
}


# -- command line and output --------------------------------------------------------------------------------------
def add_model_args(ap: argparse.ArgumentParser, default_shape: str) -> None:
    """`--shape`, `--device` and `--model-dir`: the model every model benchmark runs."""
    ap.add_argument(
        "--shape",
        choices=list(SHAPES),
        default=default_shape,
        help="a random-init Qwen2.5 model of this size (with --model-dir: made there only when it holds no model)",
    )
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to run (default: cuda when there is one); on cpu use --shape tiny",
    )
    ap.add_argument(
        "--model-dir",
        help="a Hugging Face model folder to run instead of a random one (a random one of --shape is saved here "
        "when the folder has no config.json, and reused on the next run)",
    )


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """`--set` (any config override, as on `python -m hybridrl`'s command line) and `--out`."""
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override applied to the run, e.g. --set engine.native.kv_block_size=32 (repeatable)",
    )
    add_out_arg(ap)


def add_out_arg(ap: argparse.ArgumentParser) -> None:
    """`--out FILE`: also write the JSON there."""
    ap.add_argument("--out", metavar="FILE", help="also write the JSON to this file")


def pick_device(name: str) -> torch.device:
    """The torch device for `--device`, failing clearly where CUDA was asked for and is missing."""
    if name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible here; run with --device cpu --shape tiny")
        return torch.device("cuda", 0)
    return torch.device("cpu")


def device_info(device: torch.device) -> dict:
    """The labels every result carries: the device, the GPU's name (None on the CPU) and the library versions."""
    return {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def note(message: str) -> None:
    """A progress line on stderr (stdout carries only the JSON)."""
    print(message, file=sys.stderr, flush=True)


def emit(result: dict, out: str | None) -> None:
    """Print the result as JSON on stdout and, with `out`, write it to that file too."""
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")


def exit_now() -> None:
    """Leave without the interpreter's teardown: processes that used a DeviceMesh sometimes abort in it, after the
    result is out."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- models and configs -------------------------------------------------------------------------------------------
def build_model(shape: str, device: torch.device) -> torch.nn.Module:
    """A random bf16 Qwen2 causal LM of `shape`, allocated directly on `device` (uniform in ±0.05)."""
    h, n, heads, kv, inter, vocab, tied = SHAPES[shape]
    config = transformers.Qwen2Config(
        hidden_size=h,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device=device)  # meta-built buffers (rotary) are recomputed at load, not used here
    if tied:  # to_empty gives each module its own tensor; restore the tie
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05)
    return model


def make_model_dir(shape: str, device: torch.device, root: str | None = None) -> str:
    """The model folder to run: `root` when it holds a model, else a random-init bf16 Qwen2 of `shape` (and the tiny
    byte-level tokenizer) saved to `root` or a temporary folder. Benchmarks feed token ids and never decode them; the
    multi-turn workload's tool turns are rendered by its chat template, whose tool tags are tokens of their own, as in
    Qwen2.5's tokenizer, so a tool turn has about as many tokens as there (spelled in bytes it would have 70 instead
    of 41 around 16 tokens of tool output; about 30 with Qwen2.5's)."""
    root = Path(root or tempfile.mkdtemp(prefix=f"bench_{shape}_"))
    if not (root / "config.json").exists():
        torch.manual_seed(0)
        model = build_model(shape, device)
        model.config.eos_token_id = 2  # the tokenizer's <|im_end|>
        model.save_pretrained(root, safe_serialization=True)
        build_tokenizer(tool_tokens=True).save_pretrained(root)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return str(root)


def model_vocab(model_dir: str) -> int:
    """The model's vocabulary size, from its config."""
    return transformers.AutoConfig.from_pretrained(model_dir).vocab_size


def bench_config(model_dir: str, device: torch.device, overrides: list[str] = ()) -> RunConfig:
    """The run config of `python -m hybridrl model.path=<model_dir> <overrides>`, checked as a run's is (a bad key or
    value fails here, naming it)."""
    base = [
        f"model.path={model_dir}",
        "model.name=hf",
        f"trainer.device={device.type}",
        "logger.progress_bar=false",
        "trainer.eval_every=0",
    ]
    try:
        return validate(OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.from_dotlist([*base, *overrides])))
    except (ConfigError, OmegaConfBaseException) as e:
        raise SystemExit(f"config: {e}") from e


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token ids away from the special ids (EOS is id 2)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(300, vocab, (n, length), generator=g).tolist()


# -- the product's builders ---------------------------------------------------------------------------------------
def init_single_process(device: torch.device) -> None:
    """A process group of one (FSDP2 needs one)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = tempfile.mktemp(prefix="bench_store_")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", store=dist.FileStore(store, 1), rank=0, world_size=1
    )


def bench_controller(cfg: RunConfig, prompts: list[list[int]] | list[Prompt], run_dir: str | None = None):
    """The run's own controller and worker group for `cfg`, fed `prompts` (token ids, or whole `Prompt`s when a
    reward model needs their text) instead of a data set. Like a run, it first checks the memory plan
    (`trainer.check_fit`): a workload that will not fit the device stops here, before any weights load, with the
    plan's line naming the shortfall and the settings that fit."""
    from hybridrl.controller import Controller
    from hybridrl.plan import FitError, check_fit

    try:
        check_fit(cfg)
    except FitError as e:
        raise SystemExit(f"does not fit: {e}") from e
    run_dir = run_dir or tempfile.mkdtemp(prefix="bench_run_")
    controller = Controller(cfg, run_dir, OmegaConf.to_container(OmegaConf.structured(cfg)), "bench")
    controller.setup(prompts=[p if isinstance(p, Prompt) else Prompt(p, "", {}) for p in prompts])
    return controller


def bench_worker(cfg: RunConfig, device: torch.device, with_engine: bool = True):
    """One device's roles in this process, built by the run's builder (`roles.actor`, `.ref`, `.rollout`), with the
    CPU threads a run's worker would take."""
    from hybridrl.cpu_threads import configure_threads
    from hybridrl.models.loading import resolve_model_path
    from hybridrl.workers.build import build_components

    configure_threads(cfg.cluster.cpu_threads, workers_on_node=1, model_path=resolve_model_path(cfg.model))
    if not dist.is_initialized():
        init_single_process(device)
    return build_components(cfg, cfg.topology(), device, with_engine=with_engine)


def bench_rollout(cfg: RunConfig, roles):
    """An engine for `cfg` (with its resharder), built by the builder's own `build_rollout` on `roles`' device and
    filled from `roles.actor`'s weights, as a run's engine is: one actor serves engines of several settings."""
    from hybridrl.models.loading import resolve_model_path
    from hybridrl.workers.build import build_rollout

    path = resolve_model_path(cfg.model)
    return build_rollout(cfg, path, roles.tokenizer, roles.device, roles.topology, roles.actor.model)


# -- timing -------------------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, object]:
    """Wall seconds of `fn()`, the device's work included, and its result."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


class Timer:
    """Wall time per named phase, synchronized with the device so GPU work is counted."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times, self.memory = device, {}, {}

    def sync(self) -> None:
        # The current stream only: work a phase leaves running on a side stream (the optimizer's onload
        # behind the log-prob pass) is not the caller's wait, and is charged where it is joined.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @contextmanager
    def __call__(self, name: str):
        self.sync()
        t0 = time.perf_counter()
        yield
        self.sync()
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
        if self.device.type == "cuda":
            self.memory[name] = {
                "allocated_gb": round(torch.cuda.memory_allocated(self.device) / 2**30, 3),
                "reserved_gb": round(torch.cuda.memory_reserved(self.device) / 2**30, 3),
            }


def gpu_peak_flops() -> float:
    """Dense bf16 peak used for MFU: H100/H200 SXM datasheet (989 TFLOP/s); override with BENCH_PEAK_TFLOPS."""
    return float(os.environ.get("BENCH_PEAK_TFLOPS", "989")) * 1e12


__all__ = [
    "SHAPES",
    "Timer",
    "add_model_args",
    "add_out_arg",
    "add_run_args",
    "bench_config",
    "bench_controller",
    "bench_rollout",
    "bench_worker",
    "build_model",
    "device_info",
    "emit",
    "exit_now",
    "gpu_peak_flops",
    "init_single_process",
    "make_model_dir",
    "model_vocab",
    "note",
    "pick_device",
    "random_prompts",
    "sync",
    "timed",
]
