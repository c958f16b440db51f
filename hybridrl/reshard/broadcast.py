"""Broadcast of one bucket of named tensors inside a process group, as a single flat byte buffer.

Two collectives per bucket: the metadata (names, shapes, dtypes, offsets) as a pickled object, then the bytes.
An end-of-stream marker (metadata None) tells receivers that the sync is over.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_ALIGN = 16  # byte offsets stay aligned so that every entry can be viewed back as its dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack(named: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, dict]:
    """Copy tensors into one uint8 buffer; returns it with the metadata needed to unpack it."""
    entries, total = [], 0
    for name, t in named:
        entries.append((name, tuple(t.shape), _dtype_name(t.dtype), total))
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    for (name, t), (_, _, _, off) in zip(named, entries):
        nbytes = t.numel() * t.element_size()
        flat[off : off + nbytes].view(t.dtype).view(t.shape).copy_(t)
    return flat, {"entries": entries, "nbytes": total}


def unpack(flat: torch.Tensor, meta: dict) -> dict[str, torch.Tensor]:
    """Views of the received buffer, by name (no copies)."""
    out = {}
    for name, shape, dtype_name, off in meta["entries"]:
        dtype = getattr(torch, dtype_name)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        out[name] = flat[off : off + nbytes].view(dtype).view(shape)
    return out


def send_bucket(
    named: list[tuple[str, torch.Tensor]] | None, extra: object, src: int, group, device: torch.device
) -> int:
    """Source side: broadcast a bucket (or, with None, the end marker); returns the bytes sent."""
    if named is None:
        dist.broadcast_object_list([None], src=src, group=group)
        return 0
    flat, meta = pack(named, device)
    meta["extra"] = extra
    dist.broadcast_object_list([meta], src=src, group=group)
    dist.broadcast(flat, src=src, group=group)
    return flat.numel()


def recv_bucket(src: int, group, device: torch.device) -> tuple[dict[str, torch.Tensor], object, torch.Tensor] | None:
    """Receiver side: the next bucket as (tensors by name, the sender's extra object, the flat buffer), or None
    at the end marker."""
    box: list = [None]
    dist.broadcast_object_list(box, src=src, group=group)
    meta = box[0]
    if meta is None:
        return None
    flat = torch.empty(meta["nbytes"], dtype=torch.uint8, device=device)
    dist.broadcast(flat, src=src, group=group)
    return unpack(flat, meta), meta["extra"], flat
