"""What the benchmarks share: a random-init model folder of a real shape, the run config they measure, and the
product's own builders (a benchmark measures exactly what a run executes).

    cfg = bench_config(model_dir, device, ["trainer.offload=[params,optimizer]", "engine.max_new_tokens=512"])
    controller = bench_controller(cfg, prompts)    # a GRPO step is controller.train_step(step), as in a run
    worker = bench_worker(cfg)                     # or one device's roles, to time their lifecycle calls
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from benchmarks.reshard import SHAPES, build_model
from hybridrl.config import RunConfig, validate
from hybridrl.data.prompts import Prompt
from hybridrl.models.tiny import build_tokenizer


def add_model_args(ap, default_shape: str) -> None:
    """The `--shape` (a random-init Qwen2 of that size) and `--device` options every model benchmark takes."""
    ap.add_argument("--shape", choices=sorted(SHAPES), default=default_shape)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")


def init_single_process(device: torch.device) -> None:
    """A process group of one (FSDP2 needs one)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = tempfile.mktemp(prefix="bench_store_")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", store=dist.FileStore(store, 1), rank=0, world_size=1
    )


def make_model_dir(shape: str, device: torch.device, root: str | None = None) -> str:
    """Save a random-init bf16 Qwen2 model of `shape` (plus a tokenizer) and return its folder.

    The tokenizer is the tiny byte-level one: benchmarks feed token ids directly and never decode.
    """
    root = Path(root or tempfile.mkdtemp(prefix=f"bench_{shape}_"))
    if not (root / "config.json").exists():
        model = build_model(shape, device)
        model.config.eos_token_id = 2
        model.save_pretrained(root, safe_serialization=True)
        build_tokenizer().save_pretrained(root)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return str(root)


def bench_config(model_dir: str, device: torch.device, overrides: list[str] = ()) -> RunConfig:
    """The run config of `python -m hybridrl model=hf model.path=<model_dir> <overrides>`, checked as a run's is."""
    base = [
        f"model.path={model_dir}",
        "model.name=hf",
        f"trainer.device={device.type}",
        "logger.progress_bar=false",
        "trainer.eval_every=0",
    ]
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.from_dotlist([*base, *overrides]))
    return validate(cfg)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token ids away from the special ids, so no sample stops early by chance (EOS is id 2)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(300, vocab, (n, length), generator=g).tolist()


def bench_controller(cfg: RunConfig, prompts: list[list[int]] | list[Prompt], run_dir: str | None = None):
    """The run's own controller and worker group for `cfg`, fed `prompts` (token ids, or whole `Prompt`s when a
    reward model needs their text) instead of a data set."""
    from hybridrl.controller import Controller

    run_dir = run_dir or tempfile.mkdtemp(prefix="bench_run_")
    controller = Controller(cfg, run_dir, OmegaConf.to_container(OmegaConf.structured(cfg)), "bench")
    controller.setup(prompts=[p if isinstance(p, Prompt) else Prompt(p, "", {}) for p in prompts])
    return controller


def bench_worker(cfg: RunConfig, device: torch.device, with_engine: bool = True):
    """One device's roles in this process, built by the run's builder (`roles.actor`, `.ref`, `.rollout`)."""
    from hybridrl.workers.build import build_components

    if not dist.is_initialized():
        init_single_process(device)
    return build_components(cfg, cfg.topology(), device, with_engine=with_engine)


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
    "bench_config",
    "bench_controller",
    "bench_worker",
    "gpu_peak_flops",
    "init_single_process",
    "make_model_dir",
    "random_prompts",
]
