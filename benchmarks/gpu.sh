#!/usr/bin/env bash
# The GPU benchmarks of docs/measurements, by group, each with its own time limit; JSON and logs under $OUT.
#
#   OUT=/tmp/out bash benchmarks/gpu.sh kernel engine trainer      # groups below, in any order
#
#   kernel    CUDA tests of the engine's Triton kernels, the sampler, the log-prob kernel, the engine, its scheduler
#   engine_grpo  bench_engine 1.5B GRPO-shaped: 32 prompts × 8 samples × 512 new (one prefill per group)
#   fixed_addresses  CUDA tests of fixed-address memory and graphs surviving sleep; bench_step 1.5B with
#                engine.native.fixed_addresses=true, then false (graph capture seconds and rollout tok/s in each)
#   shared_prefix  bench_engine GRPO-shaped with 512-token prompts, 1.5B then 0.5B: decode attention reading each
#                group's prompt once (engine.native.shared_prefix_tokens=512) against once per row (0), in one process
#   multiturn    bench_engine 0.5B: 256 trajectories × 4 turns with a 50 ms tool, against the same tokens single-turn,
#                then 512 trajectories on 256 rows; turns of 64 tokens, then 256; joins inside the step and apart
#   engine    bench_engine 0.5B, batch 64 × 256 new, vs HF generate and vs the torch sampler, with a profile
#   engine_more  bench_engine without CUDA graphs, and at batch 256 (0.5B × 256 new, 1.5B × 1024 new)
#   trainer   bench_trainer 1.5B, batch 8 × 1024: our update's variants vs plain FSDP2, with profiles
#   step      bench_step 1.5B: a GRPO step with trainer.offload=params,optimizer (lazy, and eager: --eager-offload)
#             and with none
#   step_large  bench_step 1.5B with offload at 64 prompts × 8 × 1024 new tokens
#   lifecycle bench_lifecycle 1.5B: sleep/wake/offload/onload/reshard seconds, GB/s, bytes freed
#   (two GPUs, kind nvidia-h200-x2)
#   scale       bench_step 1.5B on 1 GPU and on 2 (engine TP 1 ×2 replicas, TP 2), same global batch (strong) and
#               same per-GPU batch (weak); set SCALE_SET="trainer.fsdp_layers_per_unit=1 ..." to try other sharding
#   reshard_2gpu  bench_reshard 7B: FSDP over 2 GPUs → engine TP 2 (fused layout, NCCL)
#   step_7b_2gpu  bench_step 7B on 2 GPUs, engine TP 2, full offload: phases, switching, memory per phase
#   same_seed_2gpu  the tiny default on 1 and on 2 GPUs (TP 1 and 2), same seed; scripts/compare_runs.py gaps
#   ppo       bench_step 1.5B with algorithm=ppo (a 1.5B critic) and two 1.5B reward models, full offload
#   lora      bench_lora 7B: a GRPO step with LoRA rank 64 against full fine-tuning (its estimate when it does not
#             fit one H200), and the reshard with the merge against the plain reshard
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_bench_out}
mkdir -p "$OUT" && OUT=$(realpath "$OUT")
# The tools put this repo first on their own path; `python -m hybridrl` needs the installed copy (benchmarks/gpu_env.sh),
# whose hybridrl.conf resolves, so app runs below start from another folder.
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
REPO=$PWD
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
      step kernel_tests 480 env HYBRIDRL_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider tests/gpu/test_engine_kernels.py \
        tests/gpu/test_sampling_kernel.py tests/gpu/test_logprob_kernel.py tests/unit/engines/native/test_fused_engine.py tests/unit/engines/native/test_engine_scheduler.py ;;
    engine_grpo)
      step engine_1.5b_grpo 200 $PY -m benchmarks.engine --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 \
        --out "$OUT/bench_engine_1.5b_grpo_p32x8_n512.json" ;;
    fixed_addresses)
      step fixed_tests 240 env HYBRIDRL_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider tests/unit/engines/native/test_fused_engine.py \
        -k "fixed or survive"
      for v in true false; do
        mkdir -p "$OUT/fixed_$v"
        step step_1.5b_fixed_$v 200 env OUT="$OUT/fixed_$v" $PY -m benchmarks.step --shape 1.5b --device cuda \
          --set engine.native.fixed_addresses=$v
      done ;;
    shared_prefix)
      for s in 1.5b 0.5b; do
        step engine_${s}_grpo_p512 300 $PY -m benchmarks.engine --case grpo --shape $s --prompts 32 --samples 8 \
          --prompt-len 512 --new-tokens 512 --shared-prefix-tokens 512 0 --out "$OUT/bench_engine_${s}_grpo_p512_shared.json"
      done ;;
    multiturn)  # one row per trajectory, then 512 trajectories on 256 rows (more in flight than rows, as agent RL runs);
      # turns of 64 tokens, then of 256; each with joins inside the step (the default) and prefilled apart (0)
      for n in 256 1024; do
        step engine_0.5b_multiturn_n$n 240 $PY -m benchmarks.engine --case multiturn --shape 0.5b --trajectories 256 \
          --turns 4 --tool-ms 50 --new-tokens $n --join-step-tokens 0 512 --out "$OUT/bench_engine_0.5b_multiturn_256x4_n$n.json"
        step engine_0.5b_multiturn_512_n$n 240 $PY -m benchmarks.engine --case multiturn --shape 0.5b --trajectories 512 \
          --max-rows 256 --turns 4 --tool-ms 50 --new-tokens $n --join-step-tokens 0 512 \
          --out "$OUT/bench_engine_0.5b_multiturn_512on256x4_n$n.json"
      done ;;
    engine)
      step engine_0.5b_b64 200 $PY -m benchmarks.engine --device cuda --shape 0.5b --batch 64 --prompt-len 128 \
        --new-tokens 256 --torch-sampler --profile "$OUT/profile_engine_0.5b.txt" --out "$OUT/bench_engine_0.5b_b64_n256.json" ;;
    engine_more)  # no CUDA graphs; larger batches, engine only
      B="$PY -m benchmarks.engine --device cuda --skip-hf --prompt-len 128"
      step engine_0.5b_b64_eager 60 $B --shape 0.5b --batch 64 --new-tokens 256 --no-cuda-graphs \
        --out "$OUT/bench_engine_0.5b_b64_n256_eager.json"
      step engine_0.5b_b256 60 $B --shape 0.5b --batch 256 --new-tokens 256 --out "$OUT/bench_engine_0.5b_b256_n256.json"
      step engine_1.5b_b256 90 $B --shape 1.5b --batch 256 --new-tokens 1024 --out "$OUT/bench_engine_1.5b_b256_n1024.json" ;;
    trainer)
      step trainer_1.5b 420 $PY -m benchmarks.trainer --shape 1.5b --model-dir $MODELS/1.5b --profile "$OUT" \
        --variants "${TRAINER_VARIANTS:-default,eager,eager+unfused_logprobs,eager+foreach,chunk}" ;;
    step)
      for off in ${STEP_OFFLOADS:-params,optimizer params,optimizer:eager none}; do
        flag=""; [[ $off == *:eager ]] && flag=--eager-offload
        step "step_1.5b_${off//[,:]/-}" 300 $PY -m benchmarks.step --shape 1.5b --model-dir $MODELS/1.5b \
          --offload ${off%:eager} $flag
      done ;;
    step_large)  # a batch nearer to usual GRPO runs: 64 prompts × 8 samples × 1024 new tokens
      step step_1.5b_p64_n1024 420 $PY -m benchmarks.step --shape 1.5b --model-dir $MODELS/1.5b \
        --offload params,optimizer --prompts 64 --new-tokens 1024 --steps 2 ;;
    lifecycle)
      step lifecycle_1.5b 200 $PY -m benchmarks.lifecycle --shape 1.5b ;;
    scale)
      S="$PY -m benchmarks.step --shape 1.5b --model-dir $MODELS/1.5b --new-tokens 256 --micro 16 --steps 3 --warmup 2"
      X=""; for kv in ${SCALE_SET:-}; do X="$X --set $kv"; done
      step scale_w1_p32 300 $S --prompts 32 $X
      step scale_w2_tp1_p32 300 $S --prompts 32 --workers 2 $X
      step scale_w2_tp2_p32 300 $S --prompts 32 --workers 2 --tp 2 $X
      step scale_w2_tp1_p64 300 $S --prompts 64 --workers 2 $X ;;
    reshard_2gpu)
      step reshard_7b_w2_tp2 240 $PY -m benchmarks.reshard --shape 7b --device cuda --workers 2 --tp-size 2 --repeat 5 ;;
    step_7b_2gpu)
      for off in ${STEP7B_OFFLOADS:-params,optimizer params,optimizer:eager}; do
        flag=""; [[ $off == *:eager ]] && flag=--eager-offload
        step "step_7b_w2_tp2_${off//[,:]/-}" 540 $PY -m benchmarks.step --shape 7b --model-dir $MODELS/7b --workers 2 \
          --tp 2 --prompts ${STEP7B_PROMPTS:-16} --new-tokens 256 --micro 8 --steps 2 --warmup 2 --offload ${off%:eager} $flag
      done ;;
    lora)
      step lora_7b_r64 420 $PY -m benchmarks.lora --shape 7b --model-dir $MODELS/7b --rank 64 ;;
    ppo)
      step ppo_1.5b 420 $PY -m benchmarks.step --shape 1.5b --model-dir $MODELS/1.5b --algorithm ppo --reward-models 2 \
        --offload params,optimizer --steps 2 --warmup 2 ;;
    same_seed_2gpu)
      RUNS=$(realpath "$OUT")/runs
      A="$PY -m hybridrl trainer.steps=20 trainer.eval_every=0 logger.progress_bar=false"
      cd /tmp
      step same_seed_1gpu 200 $A hydra.run.dir=$RUNS/gpu1
      step same_seed_2gpu_tp1 200 $A cluster=local cluster.workers_per_node=2 hydra.run.dir=$RUNS/gpu2_tp1
      step same_seed_2gpu_tp2 200 $A cluster=local cluster.workers_per_node=2 engine.tp_size=2 hydra.run.dir=$RUNS/gpu2_tp2
      cd "$REPO"
      for r in gpu2_tp1 gpu2_tp2; do
        $PY scripts/compare_runs.py $RUNS/gpu1 $RUNS/$r > "$OUT/compare_gpu1_$r.json"
        head -c 1500 "$OUT/compare_gpu1_$r.json"; echo
      done ;;
    *) echo "unknown group $group" >&2 ;;
  esac
done
