"""Resharder in one process (plain modules): delivery, bucketing, stats, and verify catching layout bugs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.reshard import ReshardConfig, Resharder, build_layout, iter_full_layers, reference_shard
from hybridrl.reshard.layout import LayerGroup, TensorSpec, WeightLayout
from hybridrl.reshard.testing import TensorDictEngine
from tests.tiny_models import KINDS, tiny_config, tiny_model


class RecordingEngine(TensorDictEngine):
    """Remembers the names of every push."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.pushes: list[list[tuple[str, int]]] = []

    def load_weights(self, named_tensors):
        named_tensors = list(named_tensors)
        self.pushes.append([(n, t.numel() * t.element_size()) for n, t in named_tensors])
        super().load_weights(named_tensors)


def _sync(kind, style="fused", tp_rank=0, tp_size=2, layout=None, engine_dtype=torch.float32, **cfg):
    config, model = tiny_config(kind), tiny_model(kind)
    engine = RecordingEngine.from_layout(layout or build_layout(config, style, tp_rank, tp_size), dtype=engine_dtype)
    rs = Resharder(ReshardConfig(**cfg), engine, config, tp_rank=tp_rank, tp_size=tp_size, style=style, layout=layout)
    return rs, model, engine


def test_iter_full_layers_plain_module_streams_views_in_order():
    model = tiny_model("qwen3")
    groups = list(iter_full_layers(model))
    assert [g for g, _ in groups] == ["embed", "layers.0", "layers.1", "final"]
    params = dict(model.named_parameters())
    assert sum(len(t) for _, t in groups) == len(params)
    for _, tensors in groups:
        for name, t in tensors:
            assert t.data_ptr() == params[name].data_ptr()  # no copy for plain modules
    _, embed = next(iter_full_layers(model, dtype=torch.bfloat16))
    assert [t.dtype for _, t in embed] == [torch.bfloat16]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("style", ["hf", "fused"])
def test_sync_delivers_every_tensor_exactly(kind, style):
    rs, model, engine = _sync(kind, style, tp_rank=1, tp_size=2)
    stats = rs.sync(model)
    full = {n: p.detach() for n, p in model.named_parameters()}
    for name, t in engine.tensors.items():
        assert torch.equal(t, reference_shard(model.config, name, full, style=style, tp_rank=1, tp_size=2)), name
    assert stats.tensors == len(engine.tensors)
    assert stats.bytes_moved == sum(t.numel() * 4 for t in engine.tensors.values())
    assert stats.pushes == 1  # everything fits into one 256 MiB bucket
    if style == "hf":
        assert stats.peak_extra_bytes == 0  # views of the trainer's own tensors: nothing extra


@pytest.mark.parametrize("style", ["hf", "fused"])
def test_buckets_respect_the_limit_and_never_split_a_fused_group(style):
    rs, model, engine = _sync("llama", style, verify=True)
    rs.bucket_bytes = 6000  # ~ a few tensors per push
    stats = rs.sync(model)
    assert len(engine.pushes) > 3 and stats.pushes == len(engine.pushes)
    where = {name: i for i, push in enumerate(engine.pushes) for name, _ in push}
    for spec in rs.layout.specs():
        units = [s for s in rs.layout.specs() if s.unit == spec.unit]
        assert len({where[s.name] for s in units}) == 1, spec.unit
    for push in engine.pushes:
        unit_count = len({rs.layout.spec(n).unit for n, _ in push})
        assert sum(b for _, b in push) <= rs.bucket_bytes or unit_count == 1
    # extra memory is bounded by the bucket (plus, with verify, the full sources it keeps), not the model size
    largest_push = max(sum(b for _, b in push) for push in engine.pushes)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert stats.peak_extra_bytes <= 3 * largest_push and stats.peak_extra_bytes < model_bytes / 2


def test_engine_in_bf16_receives_a_cast_copy_and_verify_passes():
    rs, model, engine = _sync("qwen2", engine_dtype=torch.bfloat16, verify=True, dtype="bfloat16")
    stats = rs.sync(model)
    full = {n: p.detach() for n, p in model.named_parameters()}
    for name, t in engine.tensors.items():  # the reference shard, cast elementwise to bf16
        want = reference_shard(model.config, name, full, style="fused", tp_rank=0, tp_size=2).to(torch.bfloat16)
        assert t.dtype == torch.bfloat16 and torch.equal(t, want), name
    # The trainer holds float32: every delivered tensor is a bf16 copy, so at least the largest one was held extra.
    assert stats.peak_extra_bytes >= max(p.numel() for p in model.parameters()) * 2
    # verify compares in bf16 too: a layout bug (k and v swapped) is caught there.
    good = build_layout(tiny_config("qwen2"), "fused", 0, 2)

    def swap(spec: TensorSpec) -> TensorSpec:
        return (
            dataclasses.replace(spec, pieces=spec.pieces[:1] + spec.pieces[:0:-1]) if "qkv_proj" in spec.name else spec
        )

    rs, model, _ = _sync(
        "qwen2", layout=_broken(good, swap), engine_dtype=torch.bfloat16, verify=True, dtype="bfloat16"
    )
    with pytest.raises(HybridRLError, match=r"qkv_proj\.(weight|bias) .*max abs diff"):
        rs.sync(model)


def _broken(layout: WeightLayout, fix) -> WeightLayout:
    groups = tuple(LayerGroup(g.name, tuple(fix(s) for s in g.specs)) for g in layout.groups)
    return dataclasses.replace(layout, groups=groups)


def test_verify_catches_swapped_k_and_v():
    good = build_layout(tiny_config("llama"), "fused", 0, 2)

    def swap(spec: TensorSpec) -> TensorSpec:
        if "qkv_proj" not in spec.name:
            return spec
        q, k, v = spec.pieces
        return dataclasses.replace(spec, pieces=(q, v, k))

    rs, model, _ = _sync("llama", layout=_broken(good, swap), verify=True)
    with pytest.raises(HybridRLError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight .*max abs diff"):
        rs.sync(model)
    rs.config.verify = False
    rs.sync(model)  # without verify the corruption goes unnoticed: that is what verify is for


@dataclasses.dataclass(frozen=True)
class NaiveChunkSpec(TensorSpec):
    """The classic bug: fuse full [Q; K; V], then torch.chunk the rows across ranks."""

    tp: tuple[int, int] = (0, 1)

    def build(self, full):
        fused = torch.cat([full[s] for s in self.sources])
        return fused.chunk(self.tp[1])[self.tp[0]]


def test_verify_catches_naive_chunk_of_fused_qkv():
    good = build_layout(tiny_config("qwen3"), "fused", 1, 2)

    def naive(spec: TensorSpec) -> TensorSpec:
        if "qkv_proj" not in spec.name:
            return spec
        return NaiveChunkSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(TensorSpec)}, tp=(1, 2))

    rs, model, _ = _sync("qwen3", tp_rank=1, layout=_broken(good, naive), verify=True)
    with pytest.raises(HybridRLError, match=r"layers\.0\.self_attn\.qkv_proj\.weight differs"):
        rs.sync(model)


def test_verify_reports_engine_tensors_left_stale():
    rs, model, engine = _sync("qwen2", verify=True)
    engine.tensors["model.extra.weight"] = torch.zeros(3)
    with pytest.raises(HybridRLError, match="not updated.*model.extra.weight"):
        rs.sync(model)


def test_model_that_does_not_match_the_config_fails_loudly():
    config = tiny_config("qwen2", tie_word_embeddings=False)  # the model is tied: no lm_head parameter
    engine = TensorDictEngine.from_layout(build_layout(config, "fused", 0, 1))
    with pytest.raises(HybridRLError, match="lm_head"):
        Resharder(ReshardConfig(), engine, config).sync(tiny_model("qwen2"))


def test_config_validation():
    with pytest.raises(ConfigError, match="reshard.backend"):
        ReshardConfig(backend="nccl")
    with pytest.raises(ConfigError, match="reshard.dtype"):
        ReshardConfig(dtype="bf17")
    with pytest.raises(ConfigError, match="process group"):
        Resharder(ReshardConfig(backend="broadcast"), None, tiny_config("qwen2"))
