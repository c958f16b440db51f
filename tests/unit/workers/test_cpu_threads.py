"""CPU thread choice: an explicit request, then OMP_NUM_THREADS, then 1 for a small model, else cores per worker."""

from __future__ import annotations

import json

import pytest
import torch

from hybridrl.cpu_threads import (
    SMALL_MODEL_PARAMS,
    available_cores,
    choose_threads,
    configure_threads,
    estimate_params,
    is_small_model,
)


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


def _real_params(config: dict) -> tuple[dict, int]:
    """(config.json contents, parameter count) of the model transformers builds from `config`, on the meta device
    (no memory): the count the estimate must approximate, from an independent source."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    return hf.to_dict(), sum(p.numel() for p in model.parameters())


SHAPES = {
    # Qwen2.5-0.5B: GQA (2 kv heads of 14), tied embeddings, q/k/v biases: the estimate counts attention as 4 h^2
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        intermediate_size=4864,
        vocab_size=151936,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    # a Llama-style model without GQA and with a separate lm_head
    "llama-untied": dict(
        model_type="llama",
        hidden_size=512,
        num_hidden_layers=4,
        intermediate_size=1376,
        vocab_size=32000,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_estimate_is_near_the_parameters_transformers_builds(shape) -> None:
    config, real = _real_params(SHAPES[shape])
    assert abs(estimate_params(config) / real - 1) < 0.1, (estimate_params(config), real)


def test_small_and_large_models_are_told_apart_by_their_config(tmp_path, tiny_path) -> None:
    assert is_small_model(tiny_path)  # the demo's tiny model
    # Two Qwen2 models on either side of the threshold (about 11M and 43M parameters): one thread for the first only.
    base = dict(
        model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=True
    )
    for hidden, layers in ((256, 4), (512, 8)):
        config, real = _real_params(
            dict(base, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=3 * hidden)
        )
        folder = tmp_path / f"h{hidden}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        assert is_small_model(folder) == (real < SMALL_MODEL_PARAMS) == (hidden == 256), (hidden, real)
    assert not is_small_model(tmp_path / "missing") and not is_small_model(None)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # no sizes: not known to be small
    assert estimate_params({"model_type": "qwen2"}) is None and not is_small_model(tmp_path)
