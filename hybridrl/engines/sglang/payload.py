"""Weight payloads for `Engine.update_weights_from_tensor(..., load_format="flattened_bucket")`.

One payload per TP rank: a base64 string of a `ForkingPickler` pickle of
``{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata, ...]}``.
SGLang's scheduler of TP rank r unpickles entry r with its allow-list unpickler (`SafeUnpickler`), rebuilds the
tensors as views of the flat buffer and hands them, by HF name, to `model.load_weights`. On a GPU the flat buffer
travels as a CUDA-IPC handle, so the sender must keep it alive until the engine call returns.

The allow-list admits torch tensors/storages, builtins, `types.SimpleNamespace` and SGLang's own
`FlattenedTensorMetadata`; any class of ours in the pickle would be refused ("Blocked unsafe global"). So the
metadata entries are SGLang's class when `sglang` is importable, else `SimpleNamespace`s with the same fields
(SGLang's loader reads them by attribute).
"""

from __future__ import annotations

import base64
import io
import pickle
import types
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

_ALIGN = 16  # bytes; every tensor starts aligned so `.view(dtype)` of its slice is legal for any dtype
_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")


def sglang_metadata_class() -> type | None:
    """SGLang's `FlattenedTensorMetadata`, or None when sglang is not importable."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except ImportError:
        return None
    return FlattenedTensorMetadata


def flatten_bucket(
    named_tensors: Sequence[tuple[str, torch.Tensor]], *, use_sglang_class: bool = True
) -> dict[str, Any]:
    """The payload dict SGLang's `flattened_bucket` loader reads: every tensor's bytes in one uint8 buffer
    (on the tensors' device), plus per-tensor metadata (byte range, shape, dtype). Mixed dtypes are fine."""
    if not named_tensors:
        raise ValueError("cannot build an empty weight bucket")
    devices = {t.device for _, t in named_tensors}
    if len(devices) != 1:
        raise ValueError(f"a weight bucket must live on one device, got {sorted(map(str, devices))}")
    cls = sglang_metadata_class() if use_sglang_class else None
    make = cls if cls is not None else types.SimpleNamespace
    total, spans = 0, []
    for _, t in named_tensors:
        start = -(-total // _ALIGN) * _ALIGN
        nbytes = t.numel() * t.element_size()
        spans.append((start, start + nbytes))
        total = start + nbytes
    flat = torch.empty(total, dtype=torch.uint8, device=devices.pop())
    metadata = []
    for (name, t), (start, end) in zip(named_tensors, spans, strict=True):
        if end > start:
            flat[start:end].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        metadata.append(make(name=name, shape=t.shape, dtype=t.dtype, start_idx=start, end_idx=end, numel=end - start))
    return {"flattened_tensor": flat, "metadata": metadata}


def reconstruct(payload: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a payload dict, as views of its flat buffer (what SGLang's loader does)."""
    flat = payload["flattened_tensor"]
    return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in payload["metadata"]]


def serialize(payload: dict[str, Any]) -> str:
    """Base64 of a ForkingPickler pickle: SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)`
    when importable (after its CUDA-IPC patch that names devices by UUID), else the same format by our code."""
    if payload["flattened_tensor"].is_cuda:
        try:
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        except ImportError:
            pass
        else:
            monkey_patch_torch_reductions()  # idempotent; the scheduler applies the same patch before unpickling
    try:
        from sglang.srt.utils.common import MultiprocessingSerializer
    except ImportError:
        return forking_pickle_b64(payload)
    return MultiprocessingSerializer.serialize(payload, output_str=True)


def forking_pickle_b64(obj: Any) -> str:
    """Our own writer of SGLang's wire format: ForkingPickler (tensors travel as shared-memory / CUDA-IPC handles),
    then standard base64."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize(data: str | bytes) -> Any:
    """Inverse of `serialize`: SGLang's allow-list deserializer when importable, else plain unpickling
    (used by tests and stand-in engines; a real engine deserializes inside its scheduler processes)."""
    try:
        from sglang.srt.utils.common import MultiprocessingSerializer
    except ImportError:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
        return pickle.loads(raw)
    return MultiprocessingSerializer.deserialize(data)
