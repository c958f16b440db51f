"""What crosses between the host and a decode step: prompt tokens packed a row each, the batch's sampler mode, host
lists on their way to the device, and the step's outputs on their way back, neither waiting for the stream."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch


@dataclass
class PackedTokens:
    """Prompt tokens packed a row each: token i (id, position, cache slot) belongs to the sequence whose block table
    is row rows[i]. They run inside a decode step (a mixed step: writing K/V, feeding nothing else), or as an
    `extend`."""

    ids: list[int]
    pos: list[int]
    slots: list[int]
    rows: list[int]


@dataclass(frozen=True)
class SamplerMode:
    """How the rows of one running batch sample (the same for all of them)."""

    temperature: float
    top_k: int
    top_p: float
    seeded: bool
    kernel: bool

    @property
    def in_graph(self) -> bool:
        """Whether the sampler can run inside a CUDA graph (counter uniforms, or greedy: no generator state)."""
        return self.seeded or self.temperature == 0


_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}  # C long long, C int: 64 and 32 bits on the platforms torch runs


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list of ints, or a list of equal-length lists of ints (a matrix), on the device without waiting for the
    stream (pinned staging on CUDA). Built through `array` (a C loop over the ints) rather than `torch.tensor`, which
    inspects every element and costs 3-4 times as much: a mixed step sends thousands of ints."""
    code = _ARRAY_CODES.get(dtype)
    nested = bool(values) and isinstance(values[0], list)
    width = len(values[0]) if nested else 0
    if code is None or not values or (nested and not width):
        t = torch.tensor(values, dtype=dtype)
    elif nested:
        buf = array(code)
        for row in values:
            if len(row) != width:
                raise ValueError(f"to_device: rows of {width} and {len(row)} values")
            buf.extend(row)
        t = torch.frombuffer(buf, dtype=dtype).view(len(values), width)
    else:
        t = torch.frombuffer(array(code, values), dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class HostCopy:
    """Device tensors on their way to host memory: the copy is queued now and waited for in `result`."""

    def __init__(self, tensors: list[torch.Tensor], into: list[torch.Tensor] | None = None) -> None:
        """`into`: pinned host buffers at least as long as each tensor (else fresh ones); the caller keeps them
        untouched until `result`."""
        self.event = None
        if tensors and tensors[0].is_cuda:
            self.host = (
                [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
                if into is None
                else [h[: t.shape[0]] for h, t in zip(into, tensors)]
            )
            for h, t in zip(self.host, tensors):
                h.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = [t.clone() for t in tensors]

    def result(self) -> list[list]:
        """The tensors as Python lists (waits for the copy, and only for it)."""
        if self.event is not None:
            self.event.synchronize()
        return [h.tolist() for h in self.host]
