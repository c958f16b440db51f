"""Programmatic dependent launch (PDL) between the decode step's Triton kernels (NVIDIA Hopper and later).

A decode step of the 1.5B at 256 rows runs ~290 kernels, most of a few microseconds; between two of them the GPU
idles while the next grid is scheduled and its programs start (docs/measurements/h200_1201_s5/a_step_gaps.json:
0.42 µs a gap, 152 µs a step). With PDL a kernel is launched with the attribute that lets its programs start before
the kernel ahead of it has finished: each program first waits (`griddepcontrol.wait`) until that kernel has completed
and its writes are visible, so nothing is read early; the launch itself overlaps the tail of the kernel ahead. Each of
our kernels also signals at its start that the next may launch (`griddepcontrol.launch_dependents`), so a Triton
kernel after a Triton kernel is resident before the first ends. cuBLAS's kernels are launched by torch without the
attribute and keep plain stream order.

Why the order stays safe: every kernel launched this way waits before its first load or store, and a kernel cannot
complete before its own wait has returned, so whatever any earlier kernel wrote is visible to it. The wait is a no-op
in a kernel launched without the attribute. Captured into a CUDA graph, the launches become programmatic edges.

`enabled(x)` decides per launch (CUDA, not ROCm, compute capability ≥ 9, a Triton with grid dependency control, and
the process-wide switch `set_enabled`, on unless `engine.native.pdl=off`; with `auto` the decode runner captures
each decode graph both ways under `switched` and keeps the faster, `fused/launch_choice.py`); `launch(x)` gives the
launch's keyword arguments, and each kernel takes a `PDL: tl.constexpr` and calls `await_inputs(PDL)` first.

Where the next kernel may launch is a second process-wide setting, for benchmarks' A/B (`set_early_trigger`): at each
kernel's start (the default, measured below), or only at its completion (no explicit trigger: the launch still
carries the attribute and the wait, but fewer programs sit resident waiting for the kernels ahead). The sixteenth
session found a rollout after the trainer's first update slower only with PDL (docs/measurements/h200_1203_s16); the
seventeenth found it as slow with the trigger at completion (h200_1203_s17), which is faster before the update by
0.5%: not enough to change the default.

Measured on the H200 (docs/measurements/h200_1202_s9/): the 1.5B GRPO rollout, 256 rows × 512 new tokens, 86.3k →
88.1k and 86.8k → 89.1k tok/s on two machines, the runs interleaved in one process. Tried beside it and not kept: the
kernel ahead of a cuBLAS GEMM pulling that GEMM's weight into L2 before its wait (qkv's by the norm, then also
down_proj's by silu_mul, then also gate_up's by the norm after attention) lost 0.8%, 3.3% and 8.3% against none.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hybridrl.engines.native.kernels import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    try:  # grid dependency control: Triton 3.4 and later
        from triton.language.extra import cuda as _tl_cuda

        HAS_GDC = hasattr(_tl_cuda, "gdc_wait") and hasattr(_tl_cuda, "gdc_launch_dependents")
    except ImportError:  # pragma: no cover - depends on the install
        HAS_GDC = False
else:  # pragma: no cover - CPU wheels of torch carry no Triton
    HAS_GDC = False

_SWITCH = {"on": True, "early": True}
_CAPABLE: dict[int, bool] = {}


def set_enabled(on: bool) -> None:
    """Turn PDL on or off for every later launch in this process (graphs captured before keep their launches)."""
    _SWITCH["on"] = bool(on)


def is_enabled() -> bool:
    """The process-wide switch (`set_enabled`)."""
    return _SWITCH["on"]


@contextmanager
def switched(on: bool) -> Iterator[None]:
    """The switch set to `on` inside the block and put back after it (a capture of one kind of graph)."""
    before = _SWITCH["on"]
    _SWITCH["on"] = bool(on)
    try:
        yield
    finally:
        _SWITCH["on"] = before


def set_early_trigger(early: bool) -> None:
    """Let the next kernel launch at each kernel's start (True, the default) or only at its completion (False), for
    every later launch in this process (graphs captured before keep their launches)."""
    _SWITCH["early"] = bool(early)


def early_trigger() -> bool:
    """The trigger setting (`set_early_trigger`)."""
    return _SWITCH["early"]


def capable(device: torch.device) -> bool:
    """Whether launches on `device` can use PDL: an NVIDIA GPU of compute capability 9 or later, and a Triton that
    emits grid dependency control. Probed once per device."""
    if device.type != "cuda" or torch.version.hip is not None or not HAS_GDC:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _CAPABLE[index]


def enabled(x: torch.Tensor) -> bool:
    """Whether a kernel working on `x` is launched with PDL."""
    return _SWITCH["on"] and capable(x.device)


def launch(x: torch.Tensor) -> dict:
    """Keyword arguments for launching a kernel (that takes `PDL: tl.constexpr`) on `x`'s device: the kernel's PDL
    mode (0 off; 1 trigger the next launch at the start, then wait; 2 only wait), and with it Triton's launch option.
    The option is left out when off, so a Triton without it is unaffected."""
    if not enabled(x):
        return {"PDL": 0}
    return {"PDL": 1 if _SWITCH["early"] else 2, "launch_pdl": True}


if HAS_TRITON:

    @triton.jit
    def await_inputs(PDL: tl.constexpr):
        """With PDL: let the next kernel launch (mode 1; mode 2 leaves that to this kernel's completion), then wait
        until the kernel ahead has completed (its writes visible). Call before the kernel's first load or store."""
        if PDL:
            if PDL == 1:
                tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
