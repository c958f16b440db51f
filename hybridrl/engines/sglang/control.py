"""The `sglang.Engine` class, imported lazily, and what its control calls answer; the model's EOS ids.

SGLang is a CUDA-only install: the import happens when an engine is built, and every way it can fail ends in one
line naming the install command.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridrl.errors import HybridRLError

INSTALL_HINT = 'pip install "hybridrl[sglang]" (on a CUDA machine)'


def sglang_engine_class() -> Callable[..., Any]:
    """`sglang.Engine`, imported lazily (a CUDA-only install)."""
    try:
        import sglang
    except ImportError as exc:
        raise HybridRLError(f"engine=sglang needs SGLang: {INSTALL_HINT} ({exc})") from exc
    if (
        getattr(sglang, "__file__", None) is None
    ):  # a bare folder named sglang on sys.path (e.g. tests/unit/engines/sglang)
        raise HybridRLError(
            f"engine=sglang needs SGLang: {INSTALL_HINT} (found only a namespace package {sglang.__path__})"
        )
    try:
        return sglang.Engine
    except Exception as exc:  # noqa: BLE001 -- its import chain fails in many ways without CUDA kernels
        raise HybridRLError(
            f"SGLang is installed but its Engine cannot be imported ({type(exc).__name__}: {exc}); "
            f"it needs a CUDA machine with SGLang's own dependencies: {INSTALL_HINT}"
        ) from exc


def control_result(result: Any) -> tuple[bool, str]:
    """(success, message) of an SGLang control call: a tuple, or an object with .success/.message."""
    if result is None:
        return True, ""
    if isinstance(result, tuple):
        return bool(result[0]), str(result[1]) if len(result) > 1 else ""
    return bool(getattr(result, "success", True)), str(getattr(result, "message", ""))


def check_result(result: Any, what: str) -> None:
    """Raise RuntimeError naming `what` when SGLang refused a control call."""
    ok, message = control_result(result)
    if not ok:
        raise RuntimeError(f"{what} refused: {message}")


def model_eos_ids(path: Path) -> list[int]:
    """EOS ids from config.json and generation_config.json (SGLang knows no tokenizer with skip_tokenizer_init)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        f = path / name
        if not f.is_file():
            continue
        value = json.loads(f.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return sorted(ids)
