# Session 16 on one H200: gate_up and SiLU(gate)·up in one Triton kernel (kernels/mlp.py).
# Call `a`: the CUDA tests of the kernel and of the engine through it; the tile sweep against cuBLAS + silu_mul
# (bench_decode_kernels --what mlp), whose winners set_plans.py writes into this copy's PLANS; the 1.5B GRPO bench
# and the 0.5B at 64 rows with the fused MLP on and off, interleaved in one process; the 1.5B step. (The fused MLP is
# not in the code now: `fused_mlp_not_kept.diff` restores it.)
# Call `b`: which part of the update slows every later rollout? The step (1 warm-up, 1 timed) with bench_engine's run
# on a fresh engine after step 1's logprob and after its update, one switch of the update at a time (the fifteenth
# session's `call.sh f` showed it with `trainer.compile=false` too); the probes also record the device-wide cache
# preference and the processes holding a context on the device. First the default with --probe-pdl-off, whose engine
# without PDL is now one (the fifteenth session's flag built it with PDL on: a new engine set the switch back).
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
G="python3 tools/bench_engine.py --case grpo"
S="python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --probe-rollout --model-dir /tmp/m15"
step() { local n=$1; shift; mkdir -p $O/$n; run $n ${STEP_S:-170} env OUT=$O/$n $S "$@"; }
# Call `c` (for the next session, first): after the update only the engines launched with PDL are slower (call b). Does
# the product's update reproduce that in the bench's own process (`--process-state fsdp`: FSDP2 at one rank, forward,
# backward, the learner's clip and fused AdamW, state kept), the same without the optimizer step (`fsdp-backward`), or
# a one-rank NCCL kernel alone (`nccl-avg`)? Each with PDL on and off, interleaved (--pdl 1 0 1 0); the plain and the
# fsdp runs also with each kernel letting the next launch only at its completion (--pdl-trigger: fewer programs
# resident and waiting). (A bare eager backward + AdamW, `backward adam`, did not slow the PDL engine in session 15.)
# Call `d`: the step's probes after logprob and after the update on three engines: PDL as now, without PDL, and PDL
# triggered at completion.
# (Run in the seventeenth session, ../../h200_1203_s17/scripts/call.sh: `d` and `c1` as its call `a`, `c2`-`c4` as `b`.)
case ${1:-a} in
a)
  run a1_tests 90 env HYBRIDRL_TEST_DEVICE=cuda python3 -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/test_engine_kernels.py tests/test_fused_engine.py -k "gate_up or silu or norms or fused_mlp or pdl"
  run a2_sweep 200 python3 tools/bench_decode_kernels.py --what mlp --shapes 0.5b 1.5b --out $O/a2_mlp_sweep.json
  python3 docs/measurements/h200_1203_s16/scripts/set_plans.py $O/a2_mlp_sweep.json > $O/a2_plans.txt 2>&1
  cat $O/a2_plans.txt
  run a3_grpo_1.5b 150 $G --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 --fused-mlp 1 0 1 0 1 --out $O/a3_grpo_1.5b.json
  run a4_grpo_0.5b 80 $G --shape 0.5b --prompts 8 --samples 8 --new-tokens 256 --fused-mlp 1 0 1 0 1 --out $O/a4_grpo_0.5b.json
  mkdir -p $O/a5_step
  run a5_step 170 env OUT=$O/a5_step python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 ;;
b)
  P="--warmup 1 --steps 1 --probe-after-phases logprob update"
  STEP_S=200 step b0_default_pdl_off $P --probe-pdl-off
  STEP_S=150 step b1_unfused_adam $P --set trainer.fused_optimizer=false
  STEP_S=150 step b2_unfused_logprobs $P --set trainer.fused_logprobs=false ;;
c)
  B="$G --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 --pdl 1 0 1 0"
  T="--pdl-trigger start completion start completion"
  run c1_plain 110 $B $T --out $O/c1_plain.json
  run c2_fsdp 180 $B $T --process-state fsdp --out $O/c2_fsdp.json
  run c3_fsdp_backward 150 $B --process-state fsdp-backward --out $O/c3_fsdp_backward.json
  run c4_nccl_avg 90 $B --process-state nccl-avg --out $O/c4_nccl_avg.json ;;
d)  # then: the three arms inside the step's process, before and after the first update
  STEP_S=240 step d1_step_arms --warmup 1 --steps 1 --probe-after-phases logprob update --probe-pdl-off \
    --probe-pdl-completion ;;
esac
grep -h "^probe" $O/*.log 2>/dev/null
cd $O && tar czf /tmp/all.tgz . && mv /tmp/all.tgz $O/all.tgz && find . -mindepth 1 -name '*.log' -delete
