#!/usr/bin/env bash
# Create (or refresh) a CPU virtual environment where `import sglang` works, for tests/unit/engines/sglang's checks against
# SGLang's own code (payload deserializer, allow-list unpickler, FlattenedTensorBucket, method signatures):
#
#   scripts/setup_sglang_test_venv.sh /work/sglang-venv
#   /work/sglang-venv/bin/python -m pytest tests/unit/engines/sglang -q -o addopts=""     (runs the multiproc ones too)
#
# SGLang 0.5.23 hard-requires CUDA-only packages and pins torch==2.14.1 (a CUDA build), so it is installed with
# --no-deps, next to the CPU build of torch 2.13.0 and only the pure-python packages that
# sglang.srt.utils.common, sglang.srt.server_args, sglang.srt.sampling.sampling_params and
# sglang.srt.weight_sync.tensor_bucket import (plus triton, imported unconditionally by sglang.srt.utils.common;
# it imports without a GPU). `sglang.Engine` itself does not import here (its chain needs torchvision/CUDA
# packages): tests/unit/engines/sglang/test_sglang_api.py then reads Engine's method signatures from the installed source.
# Nothing here can run an Engine. ~3 min, ~2.5 GB (triton is 1 GB of it).
set -euo pipefail

VENV="${1:?usage: $0 VENV_PATH}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"  # any resolve that admits torch 2.14.1 pulls its CUDA build

"${PIP[@]}" install -c "$CONSTRAINTS" "torch==2.13.0" -e "$REPO[test]" \
    numpy orjson psutil pybase64 requests pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp \
    packaging triton
"${PIP[@]}" install --no-deps "sglang==0.5.23"

# Fail here, not in the tests, if the environment is wrong.
cd / && "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
assert "+cpu" in torch.__version__, f"expected the CPU build of torch, got {torch.__version__}"
from sglang.srt.utils.common import MultiprocessingSerializer, SafeUnpickler  # noqa: F401
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket  # noqa: F401
from sglang.srt.server_args import ServerArgs  # noqa: F401
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: F401
import hybridrl  # noqa: F401
print(f"ok: sglang {md.version('sglang')} (no Engine), torch {torch.__version__}")
PY
