#!/usr/bin/env bash
# The GPU benchmarks of docs/measurements, by group, each with its own time limit; JSON and logs under $OUT.
#
#   OUT=/tmp/out bash tools/gpu_bench.sh kernel engine trainer      # groups below, in any order
#
#   kernel    CUDA tests of the fused sampler, the fused log-prob kernel and the fused engine              → kernel_tests.log
#   engine    bench_engine 0.5B, batch 64 × 256 new, vs HF generate and vs the torch sampler, with a profile
#   engine_more  bench_engine without CUDA graphs, and at batch 256 (0.5B × 256 new, 1.5B × 1024 new)
#   trainer   bench_trainer 1.5B, batch 8 × 1024: our update's variants vs plain FSDP2, with profiles
#   step      bench_step 1.5B: a GRPO step with trainer.offload=params,optimizer and with none
#   step_large  bench_step 1.5B with offload at 64 prompts × 8 × 1024 new tokens
#   lifecycle bench_lifecycle 1.5B: sleep/wake/offload/onload/reshard seconds, GB/s, bytes freed
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_bench_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
MODELS=/tmp/hybridrl_bench_models

step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t0))s"
  grep -v -E "Loading weights|Writing model" "$OUT/$name.log" | tail -n 40
}

for group in "$@"; do
  case $group in
    kernel)
      step kernel_tests 150 env HYBRIDRL_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider \
        tests/test_sampling_kernel.py tests/test_logprob_kernel.py tests/test_fused_engine.py ;;
    engine)
      step engine_0.5b_b64 200 $PY tools/bench_engine.py --device cuda --shape 0.5b --batch 64 --prompt-len 128 \
        --new-tokens 256 --torch-sampler --profile "$OUT/profile_engine_0.5b.txt" --out "$OUT/bench_engine_0.5b_b64_n256.json" ;;
    engine_more)  # no CUDA graphs; larger batches, engine only
      B="$PY tools/bench_engine.py --device cuda --skip-hf --prompt-len 128"
      step engine_0.5b_b64_eager 60 $B --shape 0.5b --batch 64 --new-tokens 256 --no-cuda-graphs \
        --out "$OUT/bench_engine_0.5b_b64_n256_eager.json"
      step engine_0.5b_b256 60 $B --shape 0.5b --batch 256 --new-tokens 256 --out "$OUT/bench_engine_0.5b_b256_n256.json"
      step engine_1.5b_b256 90 $B --shape 1.5b --batch 256 --new-tokens 1024 --out "$OUT/bench_engine_1.5b_b256_n1024.json" ;;
    trainer)
      step trainer_1.5b 420 $PY tools/bench_trainer.py --shape 1.5b --model-dir $MODELS/1.5b --profile "$OUT" \
        --variants "${TRAINER_VARIANTS:-default,eager,eager+unfused_logprobs,eager+foreach,chunk}" ;;
    step)
      for off in ${STEP_OFFLOADS:-params,optimizer none}; do
        step "step_1.5b_${off//,/-}" 300 $PY tools/bench_step.py --shape 1.5b --model-dir $MODELS/1.5b --offload $off
      done ;;
    step_large)  # a batch nearer to usual GRPO runs: 64 prompts × 8 samples × 1024 new tokens
      step step_1.5b_p64_n1024 420 $PY tools/bench_step.py --shape 1.5b --model-dir $MODELS/1.5b \
        --offload params,optimizer --prompts 64 --new-tokens 1024 --steps 2 ;;
    lifecycle)
      step lifecycle_1.5b 200 $PY tools/bench_lifecycle.py --shape 1.5b ;;
    *) echo "unknown group $group" >&2 ;;
  esac
done
