"""Divergence caught where it happens: the learners' guard on the parameters' norm (lr=1e10 is refused in the step
that diverges), a sampler that stays in range whatever the logits, and non-finite logits named as divergence."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.batch import Batch
from hybridrl.engines.base import SamplingParams
from hybridrl.engines.native.hf import HFEngine
from hybridrl.engines.native.kernels.sampling import PICK_BLOCK
from hybridrl.engines.sampling import check_finite_logprobs, inverse_cdf, sample_tokens
from hybridrl.errors import ConfigError, DivergenceError
from hybridrl.models.config import ModelConfig
from hybridrl.models.loading import load_causal_lm
from hybridrl.training.config import TrainerConfig
from hybridrl.training.learner import divergence
from tests.conftest import chat_prompt


# ---------------------------------------------------------------- the guard's rule
@pytest.mark.parametrize(
    "before, after, bound, fires",
    [
        (19.17, 19.22, 2.0, False),  # a healthy step: +0.27% (the golden run's largest was 0.27%)
        (19.17, 38.33, 2.0, False),  # exactly at the bound: 38.33 / 19.17 = 1.99948
        (19.17, 38.35, 2.0, True),  # 2.0005x
        (19.17, 9.50, 2.0, True),  # shrunk below 1/2
        (19.17, 1.938e12, 2.0, True),  # lr=1e10 on the tiny model
        (19.17, math.inf, 2.0, True),
        (19.17, math.nan, 2.0, True),
        (0.0, 1e-3, 2.0, False),  # untrained adapters start at 0: only finiteness is checked
        (0.0, math.nan, 2.0, True),
    ],
)
def test_the_norm_ratio_rule(before, after, bound, fires):
    assert (divergence(before, after, bound) is not None) == fires


@pytest.mark.parametrize(
    "key, value",
    [
        ("eps", -1.0),
        ("eps", math.nan),
        ("weight_decay", -0.1),
        ("grad_clip", math.inf),
        ("min_lr_ratio", 1.5),
        ("max_param_norm_ratio", 1.0),
        ("max_param_norm_ratio", -2.0),
    ],
)
def test_optimizer_keys_torch_would_refuse_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"^trainer\.{key} must be"):
        TrainerConfig(**{key: value})
    TrainerConfig(max_param_norm_ratio=0.0)  # off


def test_critic_optimizer_keys_are_checked_too():
    from hybridrl.training.critic_config import CriticConfig

    for key, value in (("eps", -1.0), ("weight_decay", -1.0), ("lr", math.inf)):
        with pytest.raises(ConfigError, match=rf"^critic\.{key} must be"):
            CriticConfig(**{key: value})


# ---------------------------------------------------------------- the guard in a real optimizer step
def _batch(n: int = 4, width: int = 6) -> Batch:
    g = torch.Generator().manual_seed(0)
    return Batch(
        prompts=[[5, 6, 7]] * n,
        tensors={
            "responses": torch.randint(10, 60, (n, width), generator=g),
            "response_mask": torch.ones(n, width),
            "old_logprobs": torch.full((n, width), -4.0),
            "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])[:n, None].expand(n, width).contiguous(),
        },
    )


def test_lr_1e10_is_refused_in_the_step_that_diverges(tiny_path, tokenizer, process_group):
    from tests.helpers.roles import make_actor

    actor = make_actor(tiny_path, lr=1e10)
    with pytest.raises(DivergenceError) as e:
        actor.update(_batch())
    msg = str(e.value)
    assert msg.startswith("actor: one optimizer step changed the trained parameters' norm from ")
    assert (
        "(trainer.max_param_norm_ratio=2): training diverged, likely from too large a learning rate (lr=1e+10)" in msg
    )


def test_a_healthy_lr_passes_and_the_guard_can_be_turned_off(tiny_path, tokenizer, process_group):
    from tests.helpers.roles import make_actor

    make_actor(tiny_path, lr=2e-3).update(_batch())  # the demo's lr: no error
    make_actor(tiny_path, lr=1e10, max_param_norm_ratio=0.0).update(_batch())  # the guard off: the step goes through


# ---------------------------------------------------------------- the sampler whatever the logits
V = 2 * PICK_BLOCK + 44  # three blocks, the last one partly padding: both levels of the search are exercised
ROWS = {
    "nan": [math.nan] * V,
    "+inf": [math.inf] * V,
    "-inf": [-math.inf] * V,
    "one-nan": [0.0] * (V - 1) + [math.nan],
    "inf-and-minus-inf": [math.inf, -math.inf] * (V // 2),
    "huge": [3e38] * V,
    "one-huge": [0.0] * (V - 1) + [3e38],
}


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("u", [0.0, 0.5, 1 - 2**-53])
def test_inverse_cdf_stays_in_range_whatever_the_logits(row, u):
    token = inverse_cdf(torch.tensor([ROWS[row]], dtype=torch.float32), torch.tensor([u], dtype=torch.float64))
    assert 0 <= int(token) < V
    if row == "one-huge":  # finite logits sample as ever: all the mass is on the last entry
        assert int(token) == V - 1


def test_sample_tokens_on_nan_logits_gives_valid_tokens_and_nan_logprobs():
    logits = torch.full((3, 300), math.nan)
    for temperature in (1.0, 0.0):
        tokens, logprobs = sample_tokens(logits, temperature, keys=torch.tensor([1, 2, 3]), step=0)
        assert ((tokens >= 0) & (tokens < 300)).all() and torch.isnan(logprobs).all()


def test_non_finite_logprobs_are_a_divergence_error_naming_where():
    check_finite_logprobs([-0.5, -3.0], "here")
    with pytest.raises(DivergenceError, match=r"^native engine, decode position 4: 1 of 2 rows drew from logits that"):
        check_finite_logprobs([-0.5, math.nan], "native engine, decode position 4")


def test_the_transformers_engine_stops_on_non_finite_logits(tiny_path, tokenizer):
    model = load_causal_lm(tiny_path, ModelConfig(), torch.float32)
    with torch.no_grad():
        model.lm_head.weight.fill_(math.nan)
    engine = HFEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    prompts = [chat_prompt(tokenizer, "copy: 12")]
    with pytest.raises(DivergenceError, match=r"^native engine \(transformers path\), decode position 0: 1 of 1 rows"):
        engine.generate(prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=4, seed=1))


def test_the_controller_refuses_a_rollout_drawn_from_non_finite_logits():
    from hybridrl.controller import check_engine_logprobs

    elp = torch.tensor([[-0.1, -0.2, 0.0], [-0.3, math.nan, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    check_engine_logprobs(Batch(prompts=[[1]] * 2, tensors={"engine_logprobs": elp[:1], "response_mask": mask[:1]}))
    with pytest.raises(DivergenceError, match=r"^the engine drew 1 of 2 responses from logits that are not finite"):
        check_engine_logprobs(Batch(prompts=[[1]] * 2, tensors={"engine_logprobs": elp, "response_mask": mask}))
    padded = elp.clone()
    padded[0, 2] = math.nan  # past the response's end (mask 0): not a token the engine drew
    check_engine_logprobs(Batch(prompts=[[1]] * 2, tensors={"engine_logprobs": padded[:1], "response_mask": mask[:1]}))
