"""The heap is frozen while an engine serves, and given back after, nested or failing."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from hybridrl.engines.base import GenerationRequest, SamplingParams
from hybridrl.engines.config import NativeOptions
from hybridrl.engines.native.async_engine import AsyncEngine
from hybridrl.engines.native.engine import FusedEngine
from hybridrl.engines.native.frozen_heap import frozen_heap
from hybridrl.reshard import ReshardConfig, Resharder
from tests.tiny_models import PROMPTS, tiny_model


def test_nested_uses_unfreeze_with_the_last():
    before = gc.get_freeze_count()
    assert before == 0
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with frozen_heap():
            pass
        assert gc.get_freeze_count() == frozen  # the inner exit leaves the outer's freeze
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


@pytest.fixture
def engine():
    model = tiny_model("qwen3")
    e = FusedEngine(model.config, [0], 1, device="cpu", dtype=torch.float32, options=NativeOptions(max_batch_size=4))
    Resharder(ReshardConfig(), e, model.config).sync(model)
    return e


def test_the_engine_loops_run_with_the_heap_frozen(engine):
    seen = []
    step = engine.scheduler.step
    engine.scheduler.step = lambda: seen.append(gc.get_freeze_count()) or step()
    params = SamplingParams(max_new_tokens=3, seed=1)
    engine.generate_requests([GenerationRequest(PROMPTS[0], 0)], params)

    async def two():
        agent = AsyncEngine(engine)
        return await asyncio.gather(*(agent.generate(GenerationRequest(p, i), params) for i, p in enumerate(PROMPTS)))

    asyncio.run(two())
    assert seen and all(n > 0 for n in seen)
    assert gc.get_freeze_count() == 0
