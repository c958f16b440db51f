"""`trainer/compiles`: torch.compile's count is real, and packed micro-batches of varying lengths stop recompiling
the trainer's layers after the first steps (compiled here with dynamo's eager backend: the CPU has no GPU kernels,
but the guards and recompiles are the same)."""

from __future__ import annotations

import pytest
import torch

from hybridrl.training.pass_meter import compile_count
from tests.unit.training.test_packed_trainer import build, ragged_rollout


def test_compile_count_counts_first_compiles_and_recompiles():
    before = compile_count()
    f = torch.compile(lambda x: (x * 2).sin(), backend="eager", dynamic=False)
    f(torch.randn(3))
    f(torch.randn(3))  # cached: no compile
    assert compile_count() == before + 1
    f(torch.randn(4))  # a new static shape: a recompile
    assert compile_count() == before + 2


@pytest.mark.slow
def test_packed_passes_stop_recompiling_after_the_first_steps(tiny_path, process_group, monkeypatch):
    import hybridrl.training.trainer as trainer_module

    compile_ = torch.compile
    monkeypatch.setattr(trainer_module, "use_compile", lambda *args: True)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager", **kw))
    roles = build(tiny_path, max_tokens_per_micro_batch=48)
    counts = []
    for step in range(6):  # responses up to 4, 7, ... 19 tokens: other lengths, other numbers of sequences
        batch = ragged_rollout(seed=step, rows=8, width=4 + 3 * step)
        roles.actor.compute_logprobs(roles.actor.micro_batches(batch))
        counts.append(compile_count())
    assert counts[0] > 0
    assert counts[2:] == [counts[2]] * 4, counts


def test_compiled_layers_compile_more_variants_than_dynamos_default(monkeypatch):
    """The actor's, reference's and critic's layers share one code object, and dynamo keys graphs on gradients on or
    off and on frozen parameters: more variants than dynamo's default 8 a code object, which a GRPO run with a
    reference reached on a GPU. `compile_layers` lets each of them compile instead of running eagerly."""
    from hybridrl.training.fsdp import compile_layers

    class Layer(torch.nn.Module):
        def __init__(self, dtype: torch.dtype, frozen: bool) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4, dtype=dtype), requires_grad=not frozen)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * self.weight).sin()

    class Model(torch.nn.Module):
        def __init__(self, layers: list[Layer]) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(layers)

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager", **kw))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)  # dynamo's default, whatever ran before
    dtypes = (torch.float32, torch.float64, torch.bfloat16)
    layers = [Layer(dtype, frozen) for dtype in dtypes for frozen in (False, True)]
    compile_layers(Model(layers))
    before = compile_count()
    for layer in layers:
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                layer(torch.ones(4, dtype=layer.weight.dtype))
    assert compile_count() - before == 2 * len(layers)  # 12 variants of one code object, each compiled
