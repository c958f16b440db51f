"""Local reward models: what text they read, where the score is taken, one on the device at a time, combining.

Expected scores come from a plain Hugging Face forward of each re-rendered sequence on its own (no padding, the
model's own pooling), and the rendered text from the chat template written out by hand."""

from __future__ import annotations

import pytest
import torch

from hybridrl.batch import Batch
from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.rewards.base import RewardInput
from hybridrl.rewards.combine import RewardScorer, load_combine, weighted_sum
from hybridrl.rewards.config import RewardConfig
from hybridrl.rewards.reward_model import RewardModel, RewardModelConfig, RewardModelsConfig, render_for_reward_model
from hybridrl.topology import Topology
from hybridrl.training.fsdp import Precision
from tests.helpers.ppo_rewards import max_of_sources, response_length

ITEMS = [
    RewardInput(prompt="(rendered)", response="12", sample={"prompt": "copy: 12", "answer": "12"}),
    RewardInput(prompt="(rendered)", response="7 8 9 and more text", sample={"prompt": "sort: 987"}),
    RewardInput(prompt="(rendered)", response="", sample={"prompt": [{"role": "user", "content": "hi"}]}),
]


@pytest.fixture(scope="module")
def rm_paths(_cache_dir):
    from hybridrl.models.tiny_heads import ensure_tiny_reward_model

    return [str(ensure_tiny_reward_model(_cache_dir, seed=s)) for s in (1, 2)]


def make_rm(path: str, name: str = "rm", **kw) -> RewardModel:
    mesh = Topology(1, 1, 0).fsdp_mesh("cpu")
    return RewardModel(
        RewardModelConfig(name=name, **kw),
        path,
        torch.device("cpu"),
        mesh,
        Precision.for_device("auto", torch.device("cpu")),
    )


def test_rendering_uses_the_reward_models_chat_template(tokenizer):
    text = render_for_reward_model(ITEMS[0], tokenizer)
    # The tiny tokenizer's template (Qwen's markup), written out by hand.
    assert text == "<|im_start|>user\ncopy: 12<|im_end|>\n<|im_start|>assistant\n12<|im_end|>\n"
    assert render_for_reward_model(ITEMS[0], tokenizer, system_prompt="Be brief.").startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ncopy: 12"
    )

    class NoTemplate:
        chat_template = None

    assert render_for_reward_model(ITEMS[1], NoTemplate()) == "sort: 9877 8 9 and more text"
    assert render_for_reward_model(ITEMS[2], NoTemplate()) == "hi"
    no_raw = RewardInput(prompt="PROMPT ", response="x", sample={})
    assert render_for_reward_model(no_raw, NoTemplate()) == "PROMPT x"


@pytest.mark.parametrize("micro", [1, 3])
def test_score_is_the_heads_output_at_the_last_token(rm_paths, process_group, micro):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = make_rm(rm_paths[0], micro_batch_size=micro)
    got = rm.score(ITEMS)
    plain = AutoModelForSequenceClassification.from_pretrained(rm_paths[0]).eval()
    tok = AutoTokenizer.from_pretrained(rm_paths[0])
    for item, score in zip(ITEMS, got):
        ids = tok(render_for_reward_model(item, tok), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            want = plain(torch.tensor([ids])).logits[0, 0].item()
        assert score == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert len(set(round(s, 4) for s in got)) == 3  # different texts score differently: the check means something


def test_long_sequences_keep_their_last_tokens(rm_paths, process_group):
    rm = make_rm(rm_paths[0], max_length=5)
    ids = rm.token_ids(ITEMS[:1])[0]
    full = rm.tokenizer(render_for_reward_model(ITEMS[0], rm.tokenizer), add_special_tokens=False)["input_ids"]
    assert ids == full[-5:]


def test_a_reward_model_that_cannot_load_names_its_path(tmp_path, process_group):
    with pytest.raises(HybridRLError, match=f"cannot load the reward model at '{tmp_path / 'nope'}'"):
        make_rm(str(tmp_path / "nope"))


def test_two_reward_models_are_on_the_device_one_at_a_time(rm_paths, tokenizer, process_group):
    """With host offload on (forced on the CPU), scoring a batch never has two reward models' parameters on the
    device, and none is left there after the phase; the offload changes no score."""
    rms = [make_rm(p, name=n, weight=w) for p, n, w in zip(rm_paths, ("a", "b"), (0.5, -2.0))]
    plain_scores = [rm.score(ITEMS) for rm in rms]
    for rm in rms:
        rm.offloader.enabled = True
        rm.offload()
    assert not any(rm.resident for rm in rms)
    resident_while_scoring = []
    for rm in rms:
        real = rm.score

        def spy(items, _real=real, _rm=rm):
            resident_while_scoring.append([other.cfg.name for other in rms if other.resident])
            return _real(items)

        rm.score = spy
    batch = batch_of(ITEMS, tokenizer)
    scorer = RewardScorer(response_length, tokenizer, RewardConfig(weight=1.0), rms)
    for _ in range(2):
        out, stats = scorer(batch)
        scores, extras = out.scores, out.extras
        assert not any(rm.resident for rm in rms)
    assert resident_while_scoring == [["a"], ["b"]] * 2
    assert extras["a"] == pytest.approx(plain_scores[0]) and extras["b"] == pytest.approx(plain_scores[1])
    lengths = [2.0, 19.0, 0.0]
    assert extras["function"] == lengths
    want = [f + 0.5 * a - 2.0 * b for f, a, b in zip(lengths, plain_scores[0], plain_scores[1])]
    assert scores == pytest.approx(want)
    # The first model comes in behind the reward function (bytes only), the next one in the open (timed).
    assert {
        "time/reward_model/a",
        "time/reward_model/b",
        "offload/reward_model/a/onload_gb",
        "offload/reward_model/a/offload_s",
        "offload/reward_model/b/onload_s",
    } <= set(stats)


def batch_of(items: list[RewardInput], tokenizer) -> Batch:
    """A rollout batch whose decoded responses and samples are `items`."""
    ids = [tokenizer(it.response, add_special_tokens=False)["input_ids"] for it in items]
    width = max(1, max(len(i) for i in ids))
    resp = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width)
    for r, i in enumerate(ids):
        resp[r, : len(i)] = torch.tensor(i, dtype=torch.long)
        mask[r, : len(i)] = 1
    return Batch(
        [[1]] * len(items),
        {"responses": resp, "response_mask": mask},
        {
            "prompt_text": [it.prompt for it in items],
            "sample": [it.sample for it in items],
            "finish_reason": ["stop"] * len(items),
        },
    )


def test_combining_sources(tokenizer):
    assert weighted_sum({"function": [1.0, 2.0], "rm": [10.0, -10.0]}, {"function": 0.5, "rm": 0.1}) == [1.5, 0.0]
    batch = batch_of(ITEMS, tokenizer)
    # No reward model, weight 1, sum: the function's own results pass through (components included).
    out, _ = RewardScorer(response_length, tokenizer, RewardConfig())(batch)
    assert out.scores == [2.0, 19.0, 0.0] and out.extras == {}
    out, _ = RewardScorer(response_length, tokenizer, RewardConfig(weight=0.5))(batch)
    assert out.scores == [1.0, 9.5, 0.0] and out.extras == {"function": [2.0, 19.0, 0.0]}
    custom = RewardScorer(response_length, tokenizer, RewardConfig(combine="tests.helpers.ppo_rewards:max_of_sources"))
    assert custom.combine is max_of_sources and custom(batch)[0].scores == [2.0, 19.0, 0.0]
    with pytest.raises(ConfigError, match="reward.combine"):
        load_combine("tests.helpers.ppo_rewards:nope")
    with pytest.raises(ConfigError, match="reward.combine"):
        load_combine("average")


@pytest.mark.parametrize(
    "models, key",
    [
        ([{"name": "", "path": "tiny"}], "reward_model.models[0].name"),
        ([{"name": "mean", "path": "tiny"}], "reward_model.models[0].name='mean' is reserved"),
        (
            [{"name": "a", "path": "tiny"}, {"name": "a", "path": "tiny"}],
            "reward_model.models[1].name='a' is used twice",
        ),
        ([{"name": "a", "path": "tiny", "micro_batch_size": 0}], "reward_model.models[0].micro_batch_size"),
        ([{"name": "a"}], "reward_model.models[0].path is required"),
    ],
)
def test_bad_reward_model_configs_name_the_key(models, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        RewardModelsConfig(models=[RewardModelConfig(**m) for m in models])
