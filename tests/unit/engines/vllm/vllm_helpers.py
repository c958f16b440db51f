"""Helpers shared by the tests in tests/unit/engines/vllm (plain functions; the fixtures live in conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

TOL = 1e-4
"""Max |Δ log-prob| allowed between vLLM and an HF forward of the same model (float32, CPU); measured ~1e-6."""


def make_engine(tiny_path: Path, cache_root: Path, **cfg_overrides):
    from hybridrl.engines.config import EngineConfig
    from hybridrl.engines.vllm.engine import VllmEngine

    cfg = EngineConfig(name="vllm", **cfg_overrides)
    return VllmEngine(str(tiny_path), cfg, seed=0, device="cpu", cache_root=str(cache_root))


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """Our definition: log_softmax(logits / T) at the sampled tokens (T = 1 when greedy)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)
    return lp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n_new: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n_new):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def max_logprob_error(model, prompts, completions, temperature) -> float:
    err = 0.0
    for c in completions:
        ref = hf_logprobs(model, prompts[c.prompt_index], c.token_ids, temperature)
        err = max(err, (torch.tensor(c.logprobs) - ref).abs().max().item())
    return err


def perturbed(sd: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor moved by half its std: a different policy, the same shapes."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v for k, v in sd.items()}


def run_with_vllm(tmp_path: Path, *overrides: str, steps: int = 3) -> tuple[str, list[dict]]:
    """`python -m hybridrl engine=vllm` for `steps` steps of 4 prompts x 4 samples with `overrides`, in tmp_path/run;
    its log and its metrics rows (asserting it exited 0)."""
    run_dir = tmp_path / "run"
    args = ["engine=vllm", *overrides, f"trainer.steps={steps}", "data.train_batch_size=4", "algorithm.group_size=4"]
    args += ["logger.progress_bar=false", f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    r = subprocess.run(
        [sys.executable, "-m", "hybridrl", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    return log, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
