"""CPU thread choice: an explicit request, then OMP_NUM_THREADS, then 1 for a small model, else cores per worker."""

from __future__ import annotations

import json

import pytest
import torch

from hybridrl.cpu_threads import available_cores, choose_threads, configure_threads, estimate_params, is_small_model


def test_precedence() -> None:
    assert choose_threads(3, small_model=True, env={"OMP_NUM_THREADS": "2"}) == 3  # the knob wins
    assert choose_threads(None, small_model=True, env={"OMP_NUM_THREADS": "2"}) == 2  # then the user's env
    assert choose_threads(None, small_model=True, env={}) == 1  # a tiny model: one thread
    assert choose_threads(None, small_model=True, env={"OMP_NUM_THREADS": ""}) == 1  # empty = unset
    assert choose_threads(None, small_model=True, env={"OMP_NUM_THREADS": "0"}) == 1


def test_large_models_share_the_cores_among_workers(monkeypatch) -> None:
    monkeypatch.setattr("hybridrl.cpu_threads.available_cores", lambda: 16)
    assert choose_threads(None, workers_on_node=4, env={}) == 4
    assert choose_threads(None, workers_on_node=32, env={}) == 1  # never zero


def test_a_bad_request_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu_threads"):
        choose_threads(0)


def test_configure_sets_torch_and_returns_the_count() -> None:
    before = torch.get_num_threads()
    try:
        assert configure_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert available_cores() >= 1


def test_small_models_are_told_by_their_config(tmp_path, tiny_path) -> None:
    assert is_small_model(tiny_path)  # the demo's tiny model
    qwen_05b = {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    }
    # 151936*896 + 24*(4*896^2 + 3*896*4864) = 136.1M + 390.9M (attention counted as 4 h^2, without GQA savings)
    assert estimate_params(qwen_05b) == 151936 * 896 + 24 * (4 * 896 * 896 + 3 * 896 * 4864)
    (tmp_path / "config.json").write_text(json.dumps(qwen_05b))
    assert not is_small_model(tmp_path)
    assert not is_small_model(tmp_path / "missing") and not is_small_model(None)
