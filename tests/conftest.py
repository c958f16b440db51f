"""Shared fixtures: a tiny model made once per session in a temp cache, and a world-size-1 process group."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    # Keep made-up models out of the home folder, and shared by every test (and subprocess).
    path = tmp_path_factory.mktemp("hybridrl-cache")
    old = os.environ.get("HYBRIDRL_CACHE")
    os.environ["HYBRIDRL_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("HYBRIDRL_CACHE", None)
    else:
        os.environ["HYBRIDRL_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_path(_cache_dir) -> str:
    from hybridrl.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(_cache_dir))


@pytest.fixture(scope="session")
def tiny_vl_path(_cache_dir) -> str:
    """The tiny Qwen2-VL model (random init), made once per session."""
    from hybridrl.models.tiny_vl import ensure_tiny_vl_model

    return str(ensure_tiny_vl_model(_cache_dir))


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from hybridrl.models.loading import load_tokenizer

    return load_tokenizer(tiny_path)


@pytest.fixture()
def process_group():
    """A gloo group of one (FSDP2 needs a process group even on one device)."""
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        created = True
    yield
    if created and dist.is_initialized():
        dist.destroy_process_group()


def chat_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as a user turn with the generation prompt."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module: tiny matmuls gain nothing from a second thread, and on a loaded 2-core
    machine OpenMP's waiting makes them ~100x slower. Restored afterwards for the rest of the session."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
