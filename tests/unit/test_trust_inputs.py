"""Bad inputs get one-line errors naming what was wrong: reward values, reward functions that raise, model folders."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.models.loading import check_supported_architecture
from hybridrl.rewards import RewardConfig, RewardInput, batched, normalize_results, per_sample
from hybridrl.rewards.base import RewardScores, score_rewards


def items(*responses: str) -> list[RewardInput]:
    return [RewardInput(prompt=f"Q{i}", response=r, sample={"answer": "1", "id": i}) for i, r in enumerate(responses)]


# ---------------------------------------------------------------- reward values


@pytest.mark.parametrize(
    "value, match",
    [
        ("0.5", r"'score' is '0.5' \(a str\), not a real number"),
        (True, r"'score' is True \(a bool\), not a real number"),
        (np.bool_(False), r"'score' is .*False.* \(a bool_?\), not a real number"),
        (None, r"'score' is None \(a NoneType\)"),
        (1e39, r"'score' is 1e\+39, beyond float32's range"),
        (-1e39, r"'score' is -1e\+39, beyond float32's range"),
        (float("nan"), r"'score' is nan; rewards must be finite"),
    ],
)
def test_values_that_are_not_real_float32_numbers_name_function_and_sample(value, match):
    with pytest.raises(HybridRLError, match=rf"reward function my_mod:f: result 1: {match}.*sample: response='b'"):
        normalize_results([0.0, value], expected=2, name="my_mod:f", items=items("a", "b"))


def test_components_are_checked_too():
    with pytest.raises(HybridRLError, match=r"result 0: 'format' is '1' \(a str\)"):
        normalize_results([{"score": 1.0, "format": "1"}], name="f")


def test_real_numbers_of_every_kind_are_accepted():
    scores, _ = normalize_results([1, 0.5, np.float32(0.25), np.int64(2), torch.tensor(0.125), 3.4e38])
    assert scores == [1.0, 0.5, 0.25, 2.0, 0.125, 3.4e38]


# ---------------------------------------------------------------- reward functions that raise


@per_sample
def picky(item: RewardInput) -> dict[str, float]:
    if "boom" in item.response:
        raise ValueError(f"cannot parse {item.response!r}")
    return {"score": 1.0, "correct": 1.0}


def test_samples_the_function_raises_on_score_error_score_and_are_counted(caplog):
    cfg = RewardConfig(error_score=-1.0, max_error_frac=0.5)
    with caplog.at_level(logging.WARNING):
        out = score_rewards(picky, items("a", "boom", "c", "d"), cfg, name="picky")
    assert out == RewardScores([1.0, -1.0, 1.0, 1.0], {"correct": [1.0, 0.0, 1.0, 1.0]}, errors=1)
    assert "reward function picky raised on 1 of 4 samples; first: ValueError: cannot parse 'boom'" in caplog.text


def test_a_batched_function_that_raises_is_retried_per_sample():
    calls = []

    @batched
    def model_like(batch: list[RewardInput]) -> list[float]:
        calls.append(len(batch))
        if any(i.response == "boom" for i in batch):
            raise RuntimeError("bad input in batch")
        return [0.5] * len(batch)

    out = score_rewards(model_like, items("a", "b", "boom", "c"), RewardConfig(max_error_frac=0.5))
    assert out.scores == [0.5, 0.5, 0.0, 0.5] and out.errors == 1 and out.extras == {}
    assert calls == [4, 1, 1, 1, 1]


def test_past_max_error_frac_the_run_stops_naming_function_and_an_input():
    cfg = RewardConfig(fn="my_mod:picky", max_error_frac=0.25)
    out = score_rewards(picky, items("a", "boom", "c", "d"), cfg)  # 1 of 4 = 0.25: not past
    assert out.errors == 1
    with pytest.raises(HybridRLError) as e:
        score_rewards(picky, items("boom 1", "boom 2", "c", "d"), cfg)
    msg = str(e.value)
    assert "reward function my_mod:picky raised on 2 of 4 samples" in msg
    assert "ValueError: cannot parse 'boom 1'" in msg and "response='boom 1' prompt='Q0'" in msg
    assert "reward.max_error_frac=0.25" in msg and "\n" not in msg
    with pytest.raises(HybridRLError, match="raised on 1 of 4"):
        score_rewards(picky, items("a", "boom", "c", "d"), RewardConfig(max_error_frac=0.0))


def test_all_samples_failing_within_the_tolerance_scores_error_score():
    out = score_rewards(picky, items("boom", "boom"), RewardConfig(max_error_frac=1.0, error_score=0.0))
    assert out == RewardScores([0.0, 0.0], {}, errors=2)


def test_user_errors_and_bad_values_still_stop_at_once():
    @per_sample
    def needs_column(item: RewardInput) -> float:
        raise HybridRLError("math reward needs sample['answer'] or sample['ground_truth']")

    with pytest.raises(HybridRLError, match="needs sample"):
        score_rewards(needs_column, items("a", "b"), RewardConfig(max_error_frac=1.0))

    @per_sample
    def stringly(item: RewardInput):
        if item.response == "boom":
            raise ValueError("x")
        return "0.5"

    with pytest.raises(HybridRLError, match=r"'score' is '0.5' \(a str\)"):
        score_rewards(stringly, items("a", "boom"), RewardConfig(max_error_frac=1.0))


@pytest.mark.parametrize(
    "kwargs, key",
    [({"error_score": float("nan")}, "reward.error_score"), ({"max_error_frac": 1.5}, "reward.max_error_frac")],
)
def test_reward_error_config_is_checked(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        RewardConfig(**kwargs)


# ---------------------------------------------------------------- model folders


def model_dir(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_supported_models_pass(tiny_path, tmp_path):
    assert check_supported_architecture(tiny_path) == "qwen2"
    assert (
        check_supported_architecture(model_dir(tmp_path, model_type="llama", architectures=["LlamaForCausalLM"]))
        == "llama"
    )


@pytest.mark.parametrize(
    "config, match",
    [
        (
            {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
            r"model_type 'gpt2' is not supported: the trainer -> engine weight sync has layouts for "
            r"llama, qwen2, qwen3",
        ),
        (
            {"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"]},
            r"the folder holds a Qwen2ForSequenceClassification, not a causal language model",
        ),
        ({"model_type": "brand_new_arch"}, r"model_type 'brand_new_arch' is unknown to the installed transformers"),
        (
            {"model_type": "custom", "auto_map": {"AutoModelForCausalLM": "m.C"}},
            r"model_type 'custom' is defined by code inside the folder; "
            r"set model.trust_remote_code=true only if you trust",
        ),
        ({"hidden_size": 8}, r"config.json has no model_type"),
    ],
    ids=["gpt2", "classifier", "unknown", "remote-code", "no-model-type"],
)
def test_unsupported_models_fail_before_any_weights_load(tmp_path, config, match):
    with pytest.raises(ConfigError, match=r"model\.path='.*': " + match):
        check_supported_architecture(model_dir(tmp_path, **config))


def test_a_config_json_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="config.json cannot be read as JSON"):
        check_supported_architecture(str(tmp_path))


def test_trusted_remote_code_still_needs_a_weight_layout(tmp_path):
    path = model_dir(
        tmp_path, model_type="custom", auto_map={"AutoModelForCausalLM": "m.C"}, architectures=["CForCausalLM"]
    )
    with pytest.raises(ConfigError, match="model_type 'custom' is not supported"):
        check_supported_architecture(path, trust_remote_code=True)
