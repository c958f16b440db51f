"""The fused engine's decode-step kernels: each a Triton kernel beside the plain torch code it replaces.

The torch functions are the reference (and the CPU path): they follow transformers op for op, so float32 log-probs
match a trainer's forward to ~1e-6. The Triton kernels compute the same values in one pass (bf16 roundings where
transformers rounds), run on CUDA only, and are tested against the torch functions (`tests/gpu/test_engine_kernels.py`;
on CPU through `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of torch; CPU wheels have none
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False


# Tests only: with Triton's interpreter on, HYBRIDRL_KERNELS_ON_CPU=1 routes CPU tensors through the kernels too, so the
# engine's calls into them (shapes, strides, dtypes) are checked on a machine without a GPU.
ON_CPU = os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("HYBRIDRL_KERNELS_ON_CPU") == "1"


def use_triton(x: torch.Tensor, enabled: bool = True) -> bool:
    """Whether the Triton kernels may run on `x`: enabled, Triton importable, and a CUDA tensor."""
    return enabled and HAS_TRITON and (x.is_cuda or ON_CPU)
