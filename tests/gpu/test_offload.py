"""The host offload on the caching allocator: an offload left in flight gives its memory to the next allocation on
the caller's stream, and never while its copy still reads it."""

from __future__ import annotations

import pytest
import torch

from hybridrl.training.offload import HostOffloader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the caching allocator's streams need CUDA")
SHAPE = (128, 1024, 1024)  # 512 MiB of float32: a copy long enough for a reuse during it to show


def round_tripped() -> tuple[torch.Tensor, torch.Tensor, HostOffloader]:
    """A tensor that has been out and back once (its storage is then the onload's, as in every step after the
    first), a copy of its values, and its offloader. No other free block of its size is cached: an allocation of that
    size can only reuse its own."""
    torch.cuda.empty_cache()
    t = torch.randn(SHAPE, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    off = HostOffloader(lambda: [t], torch.device("cuda"))  # the current device
    assert off.offload() == off.onload() == t.untyped_storage().nbytes()
    torch.cuda.synchronize()
    return t, t.clone(), off


def test_an_allocation_during_the_copy_never_takes_the_memory_it_reads():
    t, want, off = round_tripped()
    assert off.offload(wait=False) == t.numel() * 4
    filler = torch.full(SHAPE, 7.0, device="cuda")  # an update's first allocation, while the copy runs
    off.finish()
    off.onload()
    assert torch.equal(t, want)
    assert torch.all(filler == 7.0)


def test_the_memory_of_a_joined_offload_serves_the_callers_stream():
    t, want, off = round_tripped()
    nbytes = t.untyped_storage().nbytes()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    assert off.offload(wait=False) == nbytes
    assert torch.cuda.memory_allocated() == allocated - nbytes  # freed before the copy is joined
    off.finish()
    reuse = torch.empty(SHAPE, device="cuda")  # the update, on the default stream
    assert torch.cuda.memory_reserved() == reserved  # the same block: no new device memory
    del reuse
    off.onload()
    assert torch.equal(t, want)
