#!/usr/bin/env bash
# GPU smoke test of the native engine's fused path (one H200, torch 2.11, no hydra needed); ~3 minutes, at most 6 (per-step time limits).
#
#   OUT=/tmp/out bash tools/gpu_smoke_engine.sh
#
# 1. tests/test_fused_engine.py on CUDA tensors (float32 parity with transformers, CUDA graphs vs eager,
#    sleep/wake with graph recapture)                                        → $OUT/pytest_cuda.txt
# 2. the acceptance benchmark: Qwen2.5-0.5B shape, batch 64, 128-token prompts, 256 new tokens, engine vs
#    transformers generate (goal: ≥ 20x its 903 tok/s)                      → $OUT/bench_0.5b_b64_n256.json
# 3. the same decode without CUDA graphs (what the graphs buy)               → $OUT/bench_0.5b_b64_n256_eager.json
# 4. larger runs, engine only: 0.5B batch 256 x 256, 1.5B batch 256 x 1024  → $OUT/bench_*.json
# Each step's exit code is in $OUT/summary.json; a failing step does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_smoke_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HYBRIDRL_CACHE="$OUT/cache"
PY=${PYTHON:-python}
declare -A RC

step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  RC[$name]=$?
  echo "== $name: rc=${RC[$name]} in $((SECONDS - t0))s"
  tail -n 25 "$OUT/$name.log"
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
$PY -c "import torch, transformers, sys; print(sys.version); print(torch.__version__, torch.version.cuda, transformers.__version__)" \
  > "$OUT/versions.txt" 2>&1

if $PY -c "import pytest" 2>/dev/null; then
  step pytest_cuda 90 env HYBRIDRL_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider --junitxml="$OUT/pytest_cuda.xml" tests/test_fused_engine.py
else
  echo "pytest is not installed here: step pytest_cuda skipped" | tee "$OUT/pytest_cuda.log"
  RC[pytest_cuda]=skipped
fi

B="$PY tools/bench_engine.py --device cuda"
step bench_0.5b_b64_n256 110 $B --shape 0.5b --batch 64 --prompt-len 128 --new-tokens 256 \
  --out "$OUT/bench_0.5b_b64_n256.json"
step bench_0.5b_b64_n256_eager 40 $B --shape 0.5b --batch 64 --prompt-len 128 --new-tokens 256 --skip-hf \
  --no-cuda-graphs --out "$OUT/bench_0.5b_b64_n256_eager.json"
step bench_0.5b_b256_n256 40 $B --shape 0.5b --batch 256 --prompt-len 128 --new-tokens 256 --skip-hf \
  --out "$OUT/bench_0.5b_b256_n256.json"
step bench_1.5b_b256_n1024 70 $B --shape 1.5b --batch 256 --prompt-len 128 --new-tokens 1024 --skip-hf \
  --out "$OUT/bench_1.5b_b256_n1024.json"

{
  echo "{"
  first=1
  for k in "${!RC[@]}"; do
    [ $first -eq 1 ] || echo ","
    first=0
    printf '  "%s": "%s"' "$k" "${RC[$k]}"
  done
  echo ""
  echo "}"
} > "$OUT/summary.json"
cat "$OUT/summary.json"
rm -rf "$OUT/cache"
