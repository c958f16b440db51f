# Session 20 on one H200. Call 1 ran ../../h200_1203_s19/scripts/call.sh c (the bench's actor arm with one inductor
# setting changed: only mix-order reductions off kept PDL's gain), call 2 `call.sh g TORCHINDUCTOR_MIX_ORDER_REDUCTION=0`
# (the step with it: its probe after the steps still without PDL's gain). Call 3 (this script's `a`): the step with
# mix-order and persistent reductions off together, and the step with the trainer's layers not compiled (the control:
# session 16's one run had its launches as before the steps), each with the probe after the steps, PDL on and off.
# Calls 4 and 5 ran inline (the last device minutes), both with the layers not compiled and nothing offloaded: b1 as
# `$S --probe-rollout --warmup 1 --steps 1 --probe-pdl-off --set trainer.compile=false --offload none`, b2 as
# `$S --probe-rollout --warmup 0 --steps 1 --probe-first --probe-after-phases generate logprob update
# --set trainer.compile=false --offload none`: two steps lose PDL's gain without compile, one step does not.
# Call `b` (for the next session): which part of the second step takes it, without compile or offload: the probe after
# step 1 and after step 2, then the probe after each phase of step 2 (`--probe-phases-step`).
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
S="python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --model-dir /tmp/m15"
step() { local n=$1 t=$2; shift 2; mkdir -p $O/$n; run $n $t env OUT=$O/$n "$@"; }
case ${1:-a} in
a)
  step a1_no_mix_no_persistent 230 env TORCHINDUCTOR_MIX_ORDER_REDUCTION=0 TORCHINDUCTOR_PERSISTENT_REDUCTIONS=0 \
    $S --probe-rollout --warmup 1 --steps 1 --probe-pdl-off
  step a2_no_compile 230 $S --probe-rollout --warmup 1 --steps 1 --probe-pdl-off --set trainer.compile=false ;;
b)
  N="--set trainer.compile=false --offload none"
  step b3_after_steps 200 $S --probe-rollout --warmup 0 --steps 2 --probe-after-steps 1 2 --probe-pdl-off $N
  step b4_step2_phases 260 $S --probe-rollout --warmup 0 --steps 2 --probe-phases-step 2 \
    --probe-after-phases wake generate sleep logprob update reshard --probe-pdl-off $N ;;
esac
grep -h "^probe" $O/*.log 2>/dev/null
cd $O && tar czf /tmp/all.tgz . && mv /tmp/all.tgz $O/all.tgz && find . -mindepth 1 -name '*.log' -delete
