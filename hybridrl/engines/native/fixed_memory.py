"""Device memory whose address outlives its contents: released while the engine sleeps, mapped again at the same
virtual address when it wakes, so the CUDA graphs captured over it stay valid.

A CUDA graph bakes in the addresses of every tensor its kernels read: the weights, the KV cache. Freed at sleep and
allocated again at wake, they come back elsewhere, and each rollout after a wake-up would capture its graphs again
(24–42 ms inside the 1.5B GRPO step's rollout on the H200). CUDA's virtual memory management separates
the two: `cuMemAddressReserve` holds an address range, `cuMemCreate` + `cuMemMap` back it with physical memory,
`cuMemUnmap` + `cuMemRelease` give the physical memory back and keep the range. vLLM's sleep mode keeps its graphs
the same way (its CuMemAllocator). Here the driver API is reached through ctypes: no extension to build.

`FixedMemory` is one such range, viewed as torch tensors (`view`). `release` and `restore` drop and bring back its
physical memory; the tensor views keep their addresses throughout and must not be touched in between (the engine's
asleep checks guard that). Where the driver cannot (not CUDA, an old driver, a failed probe) `fixed_memory` returns
None and the engine allocates through torch's caching allocator.
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger(__name__)

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
_ALIGN = 256  # bytes between views: what cudaMalloc guarantees, and more than any kernel here needs


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _Driver:
    """The few driver entry points used, from libcuda (loaded once)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        u64, size = ctypes.c_ulonglong, ctypes.c_size_t
        sig = {
            "cuMemGetAllocationGranularity": [ctypes.POINTER(size), ctypes.POINTER(_AllocationProp), ctypes.c_int],
            "cuMemAddressReserve": [ctypes.POINTER(u64), size, size, u64, u64],
            "cuMemAddressFree": [u64, size],
            "cuMemCreate": [ctypes.POINTER(u64), size, ctypes.POINTER(_AllocationProp), u64],
            "cuMemRelease": [u64],
            "cuMemMap": [u64, size, size, u64, u64],
            "cuMemUnmap": [u64, size],
            "cuMemSetAccess": [u64, size, ctypes.POINTER(_AccessDesc), size],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, args in sig.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int

    def __call__(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{name} failed: {msg.value.decode() if msg.value else rc}")


_driver: _Driver | None = None
# Bytes mapped now, and the most mapped since the last `reset_peak_mapped`, per device index, as torch keeps its
# allocator's: this memory is the driver's, not torch's caching allocator's, so torch.cuda.memory_allocated does not
# see it (the engine reports it: `RolloutEngine.mapped_bytes`).
_mapped: dict[int, int] = {}
_peak: dict[int, int] = {}


def _account(index: int, nbytes: int) -> None:
    _mapped[index] = _mapped.get(index, 0) + nbytes
    _peak[index] = max(_peak.get(index, 0), _mapped[index])


def mapped_bytes(device: torch.device) -> int:
    """Bytes of fixed-address memory backed by physical memory on `device` now."""
    return _mapped.get(_index(device), 0)


def peak_mapped_bytes(device: torch.device) -> int:
    """The most fixed-address memory backed at once on `device` since the last `reset_peak_mapped`."""
    return _peak.get(_index(device), 0)


def reset_peak_mapped(device: torch.device) -> None:
    """Start a new peak at what is mapped now (as torch.cuda.reset_peak_memory_stats does for its allocator)."""
    _peak[_index(device)] = mapped_bytes(device)


def _index(device: torch.device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def _drv() -> _Driver:
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


class _Interface:
    """A raw device range as `__cuda_array_interface__` bytes, which `torch.as_tensor` wraps without a copy (the
    tensor keeps this object, and so the `FixedMemory` behind it, alive)."""

    def __init__(self, owner: FixedMemory, ptr: int, nbytes: int) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }


class FixedMemory:
    """`nbytes` of device memory at an address that stays the same across `release` and `restore`."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        device = torch.device(device)
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(self.device)  # the driver calls below act on this device's (current) context
        self.prop = _AllocationProp()
        self.prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.device.index)
        gran = ctypes.c_size_t()
        _drv()(
            "cuMemGetAllocationGranularity",
            ctypes.byref(gran),
            ctypes.byref(self.prop),
            _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
        self.nbytes = max(1, -(-nbytes // gran.value)) * gran.value
        ptr = ctypes.c_ulonglong()
        _drv()("cuMemAddressReserve", ctypes.byref(ptr), self.nbytes, gran.value, 0, 0)
        self.ptr, self.handle, self._used = ptr.value, None, 0
        try:
            self.restore()
        except BaseException:
            _drv()("cuMemAddressFree", self.ptr, self.nbytes)
            raise

    @property
    def mapped(self) -> bool:
        """Whether physical memory backs the range now."""
        return self.handle is not None

    def restore(self) -> None:
        """Back the range with (new, unzeroed) physical memory again."""
        if self.mapped:
            return
        torch.cuda.set_device(self.device)
        handle = ctypes.c_ulonglong()
        try:
            _drv()("cuMemCreate", ctypes.byref(handle), self.nbytes, ctypes.byref(self.prop), 0)
        except RuntimeError:
            # The memory comes from the driver, not torch's caching allocator: hand it what torch keeps cached (only
            # now: emptying that cache waits for every copy in flight, a lazy offload's too), and try once more.
            torch.cuda.empty_cache()
            _drv()("cuMemCreate", ctypes.byref(handle), self.nbytes, ctypes.byref(self.prop), 0)
        try:
            _drv()("cuMemMap", self.ptr, self.nbytes, 0, handle.value, 0)
            access = _AccessDesc(
                _Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.device.index), _CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            )
            _drv()("cuMemSetAccess", self.ptr, self.nbytes, ctypes.byref(access), 1)
        except BaseException:
            _drv()("cuMemRelease", handle.value)
            raise
        self.handle = handle.value
        _account(self.device.index, self.nbytes)

    def release(self) -> None:
        """Give the physical memory back to the device; the address range (and every view of it) stays reserved.
        Work already queued on the range finishes first."""
        if not self.mapped:
            return
        torch.cuda.synchronize(self.device)
        _drv()("cuMemUnmap", self.ptr, self.nbytes)
        _drv()("cuMemRelease", self.handle)
        self.handle = None
        _account(self.device.index, -self.nbytes)

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next unused stretch of the range as a tensor of `shape` and `dtype` (views never overlap)."""
        n = torch.Size(shape).numel() * dtype.itemsize
        if self._used + n > self.nbytes:
            raise RuntimeError(f"FixedMemory: {n} more bytes asked of a {self.nbytes}-byte range, {self._used} used")
        raw = torch.as_tensor(_Interface(self, self.ptr + self._used, n), device=self.device)
        self._used += -(-n // _ALIGN) * _ALIGN
        return raw.view(dtype).view(shape)

    def __del__(self) -> None:  # the last view is gone: nothing reads the range any more
        try:
            self.release()
            _drv()("cuMemAddressFree", self.ptr, self.nbytes)
        except Exception:  # noqa: BLE001 - interpreter shutdown, or a driver already gone
            pass


def fixed_bytes(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes a `FixedMemory` needs for views of these shapes, in this order."""
    return sum(-(-torch.Size(s).numel() * d.itemsize // _ALIGN) * _ALIGN for s, d in shapes)


def fixed_memory(nbytes: int, device: torch.device) -> FixedMemory | None:
    """A `FixedMemory` of `nbytes` on `device`, or None where it cannot be had (not CUDA; the driver refused: then
    said once in the log)."""
    if torch.device(device).type != "cuda":
        return None
    try:
        return FixedMemory(nbytes, device)
    except (OSError, AttributeError, RuntimeError) as e:
        log.warning("native engine: no fixed-address device memory (%s); graphs are captured again after each sleep", e)
        return None
