"""Tests against real vLLM (the CPU build). Run in the vLLM venv (scripts/setup_vllm_cpu_venv.sh):

    /work/vllm-venv/bin/python -m pytest tests/unit/engines/vllm -q

Where `import vllm` fails (the default venv), every test here is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
try:
    # Not a bare `import vllm`: with tests/ on sys.path that finds this folder as a namespace package.
    from vllm import LLM  # noqa: F401

    VLLM_MISSING = None
except Exception as exc:  # noqa: BLE001 -- any failure to import means: no usable vLLM here
    VLLM_MISSING = f"needs vLLM (CPU venv: scripts/setup_vllm_cpu_venv.sh); here: {type(exc).__name__}: {exc}"


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs a real vLLM install (tests/unit/engines/vllm; the vLLM CPU venv)")


def pytest_collection_modifyitems(config, items):
    if VLLM_MISSING is None:
        return
    skip = pytest.mark.skip(reason=VLLM_MISSING)
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_tiny_path(tmp_path_factory) -> Path:
    """The tiny Qwen2 model in a shape vLLM's CPU attention takes (head_dim 32; the default 16 is unsupported),
    with the final norm scaled ×3 so next-token distributions are far from uniform (sharper test)."""
    from safetensors.torch import load_file, save_file

    from hybridrl.models.tiny import ensure_tiny_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = ensure_tiny_model(
        tmp_path_factory.mktemp("models"), hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256
    )
    dst = tmp_path_factory.mktemp("sharp") / "tiny"
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    sd["model.norm.weight"] = sd["model.norm.weight"] * 3  # entropy ~5 nats (×10 collapses to one token)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def vllm_state_dict(vllm_tiny_path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(vllm_tiny_path / "model.safetensors"))


@pytest.fixture(scope="session")
def vllm_hf_model(vllm_tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_tiny_path, dtype=torch.float32).eval()
