"""The weight payload our code builds, read back by SGLang's own code (when sglang is importable): its base64
normalisation, its allow-list unpickler and its FlattenedTensorBucket reconstruction.

Set up a venv where `sglang` imports on CPU with `scripts/setup_sglang_test_venv.sh /work/sglang-venv`, then
`/work/sglang-venv/bin/python -m pytest tests/unit/engines/sglang -q`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hybridrl.engines.sglang import payload as wire

NO_SGLANG = (
    "sglang is not importable here (CUDA-only install); scripts/setup_sglang_test_venv.sh makes a venv where it is"
)


def tensors() -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes with odd byte sizes, so a tensor after a bf16 one would be misaligned without padding."""
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(3, 3, generator=g)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(3, generator=g).to(torch.float16)),
        ("model.layers.0.self_attn.k_norm.weight", torch.randn(7, generator=g, dtype=torch.float64)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(2, 4, generator=g).t()),  # non-contiguous
        ("scalar", torch.tensor(3, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
    ]


def assert_same(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


def sglang_reconstruct(data) -> list[tuple[str, torch.Tensor]]:
    """What SGLang 0.5.23 does with one rank's payload: normalise (engine.py `_serialize_tensors_per_rank`),
    deserialize with the allow-list unpickler (tp_worker.py `deserialize_own_rank`), rebuild the metadata by
    attribute and reconstruct (model_runner_components/weight_updater.py `_update_weights_from_flattened_bucket`)."""
    from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    [raw] = normalize_serialized_named_tensor_payloads([data])
    d = MultiprocessingSerializer.deserialize(raw)
    meta = [
        FlattenedTensorMetadata(
            name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel
        )
        for m in d["metadata"]
    ]
    return FlattenedTensorBucket(flattened_tensor=d["flattened_tensor"], metadata=meta).reconstruct_tensors()


def test_bucket_layout_and_round_trip():
    want = tensors()
    bucket = wire.flatten_bucket(want)
    flat, meta = bucket["flattened_tensor"], bucket["metadata"]
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    for m, (name, t) in zip(meta, want, strict=True):
        assert (
            m.name == name
            and m.start_idx % 16 == 0
            and m.numel == m.end_idx - m.start_idx == t.numel() * t.element_size()
        )
    assert_same(wire.reconstruct(bucket), want)
    assert_same(wire.reconstruct(wire.deserialize(wire.serialize(bucket))), want)


def test_empty_or_mixed_device_bucket_is_refused():
    with pytest.raises(ValueError, match="empty"):
        wire.flatten_bucket([])
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="one device"):
            wire.flatten_bucket([("a", torch.zeros(1)), ("b", torch.zeros(1, device="cuda"))])


@pytest.mark.parametrize("use_sglang_class", [True, False], ids=["sglang-metadata", "namespace-metadata"])
@pytest.mark.parametrize("writer", ["ours", "sglang"])
def test_sglang_reads_our_payload(use_sglang_class, writer):
    common = pytest.importorskip("sglang.srt.utils.common", reason=NO_SGLANG)
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    want = tensors()
    bucket = wire.flatten_bucket(want, use_sglang_class=use_sglang_class)
    assert isinstance(bucket["metadata"][0], FlattenedTensorMetadata) == use_sglang_class
    if writer == "ours":
        data = wire.forking_pickle_b64(bucket)
    else:
        data = common.MultiprocessingSerializer.serialize(bucket, output_str=True)
    assert isinstance(data, str)
    assert_same(sglang_reconstruct(data), want)


def test_adapter_serializer_is_sglangs_when_importable():
    pytest.importorskip("sglang.srt.utils.common", reason=NO_SGLANG)
    want = tensors()
    assert_same(sglang_reconstruct(wire.serialize(wire.flatten_bucket(want))), want)


@dataclass
class Foreign:
    name: str


def test_sglang_allow_list_refuses_foreign_classes():
    """Proves the round trip above went through the allow-list: a class of ours in the pickle is refused."""
    common = pytest.importorskip("sglang.srt.utils.common", reason=NO_SGLANG)
    bucket = wire.flatten_bucket([("x", torch.zeros(2))])
    bucket["metadata"] = [Foreign("x")]
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        common.MultiprocessingSerializer.deserialize(wire.forking_pickle_b64(bucket))
