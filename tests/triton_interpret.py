"""Test helper: make Triton's interpreter (TRITON_INTERPRET=1, kernels on CPU tensors) run with numpy >= 2.4.

Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into loop bounds with int(), which numpy
>= 2.4 refuses for arrays of one dimension; importing this module makes it take the element instead. Nothing changes
unless the interpreter is on.
"""

from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        from triton.runtime import interpreter as _interpreter
    except ImportError:  # no triton: the kernel tests skip themselves
        _interpreter = None
    if _interpreter is not None and not getattr(_interpreter, "_hybridrl_patched", False):
        _patch = _interpreter._patch_lang_tensor

        def _patch_index(tensor, scope):
            _patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interpreter._patch_lang_tensor = _patch_index
        _interpreter._hybridrl_patched = True
