#!/usr/bin/env bash
# The GPU benchmarks and CUDA tests, by group, each command with its own time limit; JSON, logs and profiles under $OUT.
#
#   OUT=/tmp/out bash benchmarks/gpu.sh kernel engine trainer step     # any groups below, in any order
#
# One GPU (an H200 for the figures in benchmarks/RESULTS.md):
#   kernel        CUDA tests of the native engine and the trainer's kernels: kernel_ops, kernel_fused, kernel_scheduler,
#                 kernel_vl (on a cold H100 the fused engine's file alone took more than 420 s: one group a call there)
#   kernel_ops    the Triton kernels, the sampler and log-prob kernels, chunked log-probs through them (tests/gpu)
#   kernel_fused  the fused engine: fixed-address memory, graphs surviving sleep, PDL, weights from FSDP
#   kernel_scheduler  its scheduler: shared prompt blocks, joins inside a step, the driver thread, the prefix table
#   kernel_vl     image prompts on the fused engine (Qwen2-VL, Qwen2.5-VL) and the prefix table's image keys
#   kernel_sweep  benchmarks.kernels: launch sweeps of the decode GEMMs and attention at the 0.5B and 1.5B shapes
#   engine        benchmarks.engine: 0.5B, 64 prompts × 256 new against HF generate (with a profile); 1.5B GRPO-shaped,
#                 32 prompts × 8 samples × 512 new
#   engine_settings  benchmarks.engine, settings side by side in one process: decode attention reading a group's
#                 shared prompt once or per row (512-token prompts, 1.5B and 0.5B); CUDA graphs on and off; PDL on and
#                 off; the sampler kernel against the torch path; 256 rows (0.5B × 256 new, 1.5B × 1024 new)
#   multiturn     benchmarks.engine --case multiturn, 0.5B: the run's agent rollout (the worker's generate phase,
#                 rollout=agent), 512 trajectories on 256 rows × 4 turns cut at random points, a 50 ms tool; turns of
#                 256 tokens, then 64; each against the same tokens single-turn
#   multiturn_host the 64-token multi-turn row with --host-timing: per engine step, the driver's host work and its
#                 wait for the device, and the event loop's share of the wall time (benchmarks/host_timing.py)
#   multiturn_gil the 64-token multi-turn row with the interpreter's thread switch interval at 5 ms (Python's default)
#                 and at 0.5 ms: how long the engine's driver thread waits for the GIL while the agents run
#   trainer       benchmarks.trainer 1.5B, batch 8 × 1024: the actor's update in several configurations against plain
#                 FSDP2, with profiles ($TRAINER_VARIANTS overrides the list)
#   step          benchmarks.step 1.5B: a GRPO step with trainer.offload=params,optimizer (lazy, then eager) and none
#                 ($STEP_OFFLOADS overrides the list); fixed device addresses on and off
#   step_large    benchmarks.step 1.5B at 64 prompts × 8 × 1024 new tokens
#   partial       benchmarks.step 1.5B --partial: 32 prompts × 8 on the heavy-tailed mix (90% 64–512 tokens, 10% at
#                 4,096), synchronous steps then rollout.partial (carry, oversample 1.5, max_staleness 1); micro-
#                 batches of 16,384 tokens (by rows, 16 × 4,224 tokens, the update needs about 155 GiB). Over-sampling
#                 below about 1.3 cannot stop early on this mix (docs/partial-rollouts.md); 1.5 keeps 640 sequences
#                 in flight, about 79 GiB of engine, so this group needs the H200. Both sides train with
#                 algorithm.rollout_correction=token_mis, which partial rollouts need (docs/partial-rollouts.md)
#   lengths       benchmarks.step 1.5B on log-normal response lengths, packed against padded
#                 (trainer.padding_free=false), and on fixed lengths
#   fit           benchmarks.step 0.5B and 1.5B with default settings: memory/estimate_gb/* beside the measured
#                 memory/*/peak_allocated_gb in each JSON's memory_after_phase
#   step_7b       benchmarks.step 7B full-parameter GRPO, 16 prompts × 8 × 256, with the settings the fit estimate
#                 proposes (gradient checkpointing, trainer.optimizer_on_host)
#   default_run   the tiny default run (python -m hybridrl), twice: the second with the model cached; its wall time
#                 and trainer/compiles per step
#   vl            benchmarks.step --vl 3b: a random-init Qwen2.5-VL-3B, 16 prompts × 8, one 448×448 picture each;
#                 VL_SET="key=value ..." adds overrides (on an 80 GB card the plan asks for trainer.optimizer_on_host=true)
#   lifecycle     benchmarks.lifecycle 1.5B: sleep/wake/offload/onload/reshard seconds, GB/s, bytes freed
#   ppo           benchmarks.step 1.5B with algorithm=ppo (a 1.5B critic) and two 1.5B reward models
#   lora          benchmarks.lora 7B: a GRPO step with LoRA rank 64 against full fine-tuning (estimated where it does
#                 not fit), and the reshard with the merge against the plain reshard
# Two GPUs (one host):
#   scale         benchmarks.step 1.5B on 1 GPU and on 2 (engine TP 1 × 2 replicas, TP 2), the same global batch
#                 (strong) and the same per-GPU batch (weak); SCALE_SET="key=value ..." adds overrides
#   reshard_2gpu  benchmarks.reshard 7B: FSDP over 2 GPUs → engine TP 2
#   step_7b_2gpu  benchmarks.step 7B on 2 GPUs, engine TP 2, full offload
#   same_seed_2gpu  the tiny default run on 1 and on 2 GPUs (TP 1 and 2) with the same seed; scripts/compare_runs.py
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_bench_out}
mkdir -p "$OUT" && OUT=$(realpath "$OUT")
# `python -m hybridrl` runs from another folder below, so it needs the installed copy (benchmarks/gpu_env.sh); the
# benchmarks run from this folder, where `benchmarks` is importable.
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
REPO=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # as benchmarks/gpu_env.sh says
PY=${PYTHON:-python3}
# A test running past 200 s prints every thread's stack (a hang shows where it waits) and goes on.
PYTEST="$PY -m pytest -q -p no:cacheprovider -o faulthandler_timeout=200"
MODELS=/tmp/hybridrl_bench_models  # random-init model folders, made by the first benchmark that needs one

run() {  # run NAME TIMEOUT_S CMD...: the command's output to $OUT/NAME.log, its tail here
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t0))s"
  grep -v -E "Loading weights|Writing model" "$OUT/$name.log" | tail -n 40
}

bench() {  # bench NAME TIMEOUT_S MODULE ARGS...: python -m benchmarks.MODULE ARGS, its JSON to $OUT/NAME.json
  local name=$1 limit=$2 module=$3
  shift 3
  run "$name" "$limit" $PY -m "benchmarks.$module" "$@" --out "$OUT/$name.json"
}

KERNEL_GROUPS=(kernel_ops kernel_fused kernel_scheduler kernel_vl)
groups=()
for g in "$@"; do if [[ $g == kernel ]]; then groups+=("${KERNEL_GROUPS[@]}"); else groups+=("$g"); fi; done
for group in "${groups[@]}"; do
  case $group in
    kernel_ops)
      run kernel_tests_ops 540 env HYBRIDRL_TEST_DEVICE=cuda $PYTEST tests/gpu \
        tests/unit/training/test_chunked_logprobs.py ;;
    kernel_fused)
      run kernel_tests_fused 580 env HYBRIDRL_TEST_DEVICE=cuda $PYTEST \
        tests/unit/engines/native/test_fused_engine.py ;;
    kernel_scheduler)
      run kernel_tests_scheduler 580 env HYBRIDRL_TEST_DEVICE=cuda $PYTEST \
        tests/unit/engines/native/test_engine_scheduler.py tests/unit/engines/native/test_engine_blocks.py ;;
    kernel_vl)
      run kernel_tests_vl 400 env HYBRIDRL_TEST_DEVICE=cuda $PYTEST \
        tests/unit/engines/native/test_fused_vl.py ;;
    kernel_sweep)
      bench kernel_sweep 540 kernels --what linear attention --shapes 0.5b 1.5b ;;
    engine)
      bench engine_0.5b_b64_n256 200 engine --device cuda --shape 0.5b --model-dir $MODELS/0.5b --batch 64 \
        --prompt-len 128 --new-tokens 256 --profile "$OUT/profile_engine_0.5b.txt"
      bench engine_1.5b_grpo_p32x8_n512 200 engine --device cuda --case grpo --shape 1.5b --model-dir $MODELS/1.5b \
        --prompts 32 --samples 8 --new-tokens 512 ;;
    engine_settings)
      for s in 1.5b 0.5b; do
        bench engine_${s}_grpo_p512_shared_prefix 300 engine --device cuda --case grpo --shape $s \
          --model-dir $MODELS/$s --prompts 32 --samples 8 --prompt-len 512 --new-tokens 512 \
          --vary engine.native.shared_prefix_tokens=512,0
      done
      E05="engine --device cuda --skip-hf --shape 0.5b --model-dir $MODELS/0.5b --prompt-len 128"
      E15="engine --device cuda --skip-hf --shape 1.5b --model-dir $MODELS/1.5b --prompt-len 128"
      bench engine_0.5b_b64_graphs 120 $E05 --batch 64 --new-tokens 256 --vary engine.native.cuda_graphs=true,false
      bench engine_0.5b_b64_sampler 120 $E05 --batch 64 --new-tokens 256 --vary engine.native.sampler_kernel=true,false
      bench engine_1.5b_grpo_pdl 200 $E15 --case grpo --prompts 32 --samples 8 --new-tokens 512 \
        --vary engine.native.pdl=on,off
      bench engine_0.5b_b256_n256 90 $E05 --batch 256 --new-tokens 256
      bench engine_1.5b_b256_n1024 120 $E15 --batch 256 --new-tokens 1024 ;;
    multiturn)  # 512 trajectories on 256 rows (more in flight than rows, as agent RL runs), 4 turns, a 50 ms tool
      for n in 256 64; do
        bench engine_0.5b_multiturn_512on256x4_t$n 420 engine --device cuda --case multiturn --shape 0.5b \
          --model-dir $MODELS/0.5b --trajectories 512 --max-rows 256 --turns 4 --turn-tokens $n --tool-ms 50
      done ;;
    multiturn_host)
      bench engine_0.5b_multiturn_512on256x4_t64_host 300 engine --device cuda --case multiturn --shape 0.5b \
        --model-dir $MODELS/0.5b --trajectories 512 --max-rows 256 --turns 4 --turn-tokens 64 --tool-ms 50 \
        --host-timing ;;
    multiturn_gil)  # the 64-token multi-turn row at Python's default thread switch interval and at 0.5 ms
      for ms in 5 0.5; do
        bench engine_0.5b_multiturn_512on256x4_t64_switch${ms}ms 300 engine --device cuda --case multiturn --shape 0.5b \
          --model-dir $MODELS/0.5b --trajectories 512 --max-rows 256 --turns 4 --turn-tokens 64 --tool-ms 50 \
          --switch-interval-ms $ms
      done ;;
    trainer)
      bench trainer_1.5b 420 trainer --device cuda --shape 1.5b --model-dir $MODELS/1.5b --profile "$OUT" \
        --variants "${TRAINER_VARIANTS:-default,eager,eager+unfused_logprobs,eager+foreach,chunk}" ;;
    step)
      for off in ${STEP_OFFLOADS:-params,optimizer params,optimizer:eager none}; do
        flag=""; [[ $off == *:eager ]] && flag=--eager-offload
        bench "step_1.5b_offload-${off//[,:]/-}" 300 step --device cuda --shape 1.5b --model-dir $MODELS/1.5b \
          --offload ${off%:eager} $flag
      done
      for v in true false; do
        bench step_1.5b_fixed_addresses_$v 300 step --device cuda --shape 1.5b --model-dir $MODELS/1.5b \
          --set engine.native.fixed_addresses=$v
      done ;;
    step_large)
      bench step_1.5b_p64_n1024 420 step --device cuda --shape 1.5b --model-dir $MODELS/1.5b --prompts 64 \
        --new-tokens 1024 --steps 2 ;;
    partial)
      bench step_1.5b_partial_heavy_n4096 600 step --device cuda --shape 1.5b --model-dir $MODELS/1.5b --prompts 32 \
        --group 8 --new-tokens 4096 --lengths heavy --partial --oversample 1.5 --max-staleness 1 --warmup 2 \
        --steps 4 --max-tokens 16384 --set algorithm.rollout_correction=token_mis ;;
    lengths)
      for v in true false; do
        bench step_1.5b_lognormal_padding_free_$v 420 step --device cuda --shape 1.5b --model-dir $MODELS/1.5b \
          --lengths lognormal --set trainer.padding_free=$v
      done
      bench step_1.5b_fixed 300 step --device cuda --shape 1.5b --model-dir $MODELS/1.5b --lengths fixed ;;
    fit)
      for s in 0.5b 1.5b; do
        bench fit_$s 300 step --device cuda --shape $s --model-dir $MODELS/$s --prompts 16 --new-tokens 256 \
          --steps 2 --warmup 1
      done ;;
    step_7b)
      bench step_7b_optimizer_on_host 450 step --device cuda --shape 7b --model-dir $MODELS/7b --prompts 16 \
        --group 8 --new-tokens 256 --set model.gradient_checkpointing=true --set trainer.optimizer_on_host=true \
        --steps 2 --warmup 1 --throughput-iters 0 ;;
    default_run)
      cd /tmp
      for i in 1 2; do
        run default_run_$i 300 $PY -m hybridrl logger.progress_bar=false hydra.run.dir=$OUT/runs/default_$i
      done
      cd "$REPO"
      $PY - "$OUT/runs/default_2/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(json.dumps({"steps": len(rows), "compiles": [r.get("trainer/compiles") for r in rows][:12],
                  "compiles_last": rows[-1].get("trainer/compiles"),
                  "step_s_sum": round(sum(r.get("time/step", 0.0) for r in rows), 2)}))
PY
      ;;
    vl)
      X=""; for kv in ${VL_SET:-}; do X="$X --set $kv"; done
      bench step_vl_3b_i448 540 step --device cuda --vl 3b --image-size 448 --prompts 16 --group 8 --new-tokens 256 $X ;;
    lifecycle)
      bench lifecycle_1.5b 200 lifecycle --device cuda --shape 1.5b --model-dir $MODELS/1.5b ;;
    ppo)
      bench ppo_1.5b 420 step --device cuda --shape 1.5b --model-dir $MODELS/1.5b --algorithm ppo --reward-models 2 \
        --steps 2 --warmup 2 ;;
    lora)
      bench lora_7b_r64 420 lora --device cuda --shape 7b --model-dir $MODELS/7b --rank 64 ;;
    scale)
      S="step --device cuda --shape 1.5b --model-dir $MODELS/1.5b --new-tokens 256 --micro 16 --steps 3 --warmup 2"
      X=""; for kv in ${SCALE_SET:-}; do X="$X --set $kv"; done
      bench scale_w1_p32 300 $S --prompts 32 $X
      bench scale_w2_tp1_p32 300 $S --prompts 32 --workers 2 $X
      bench scale_w2_tp2_p32 300 $S --prompts 32 --workers 2 --tp 2 $X
      bench scale_w2_tp1_p64 300 $S --prompts 64 --workers 2 $X ;;
    reshard_2gpu)
      bench reshard_7b_w2_tp2 300 reshard --device cuda --shape 7b --model-dir $MODELS/7b --workers 2 --tp 2 \
        --repeat 5 ;;
    step_7b_2gpu)
      for off in ${STEP7B_OFFLOADS:-params,optimizer params,optimizer:eager}; do
        flag=""; [[ $off == *:eager ]] && flag=--eager-offload
        bench "step_7b_w2_tp2_offload-${off//[,:]/-}" 540 step --device cuda --shape 7b --model-dir $MODELS/7b \
          --workers 2 --tp 2 --prompts ${STEP7B_PROMPTS:-16} --new-tokens 256 --micro 8 --steps 2 --warmup 2 \
          --offload ${off%:eager} $flag
      done ;;
    same_seed_2gpu)
      RUNS=$OUT/runs
      A="$PY -m hybridrl trainer.steps=20 trainer.eval_every=0 logger.progress_bar=false"
      cd /tmp
      run same_seed_1gpu 200 $A hydra.run.dir=$RUNS/gpu1
      run same_seed_2gpu_tp1 200 $A cluster=local cluster.workers_per_node=2 hydra.run.dir=$RUNS/gpu2_tp1
      run same_seed_2gpu_tp2 200 $A cluster=local cluster.workers_per_node=2 engine.tp_size=2 \
        hydra.run.dir=$RUNS/gpu2_tp2
      cd "$REPO"
      for r in gpu2_tp1 gpu2_tp2; do
        $PY scripts/compare_runs.py $RUNS/gpu1 $RUNS/$r > "$OUT/compare_gpu1_$r.json"
        head -c 1500 "$OUT/compare_gpu1_$r.json"; echo
      done ;;
    *) echo "unknown group $group (see the list at the top of benchmarks/gpu.sh)" >&2 ;;
  esac
done
