"""LoRA into vLLM: the resharder streams each adapted weight merged, W + (alpha/rank)·B·A, under its HF name; vLLM
then samples and scores exactly as an HF forward of PEFT's own merged model (float32 CPU, 1e-4), and as the
trainer's PEFT model with its adapters on."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model

from hybridrl.engines.base import SamplingParams
from hybridrl.reshard import ReshardConfig, Resharder
from tests.unit.engines.vllm.vllm_helpers import TOL, make_engine, max_logprob_error

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 90, 91, 92]]
SAMPLED = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=5)


@pytest.fixture(scope="module")
def engine(vllm_tiny_path, tmp_path_factory):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    eng = make_engine(vllm_tiny_path, tmp_path_factory.mktemp("vllm-cache"))
    yield eng
    eng.shutdown()
    dist.destroy_process_group()


def test_merged_adapters_reach_vllm(engine, vllm_hf_model):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(copy.deepcopy(vllm_hf_model), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if ".lora_B." in name:  # as after training (PEFT starts B at 0)
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    merged = copy.deepcopy(peft).merge_and_unload().eval()
    before = engine.generate(PROMPTS, SAMPLED)
    assert max_logprob_error(merged, PROMPTS, before, 1.0) > 10 * TOL  # the adapters change the policy

    engine.wake_up(["weights"])
    stats = Resharder(ReshardConfig(bucket_mb=1), engine, vllm_hf_model.config).sync(peft)
    engine.finish_weight_update()
    assert stats.lora_merged == 7 * vllm_hf_model.config.num_hidden_layers  # 7 projections per layer
    out = engine.generate(PROMPTS, SAMPLED)
    err = max_logprob_error(merged, PROMPTS, out, 1.0)
    print(f"vLLM after the merged push: max |Δ log-prob| vs PEFT's merged model = {err:.2e}")
    assert err < TOL
    assert max_logprob_error(peft.eval(), PROMPTS, out, 1.0) < TOL  # the PEFT model itself, adapters on
