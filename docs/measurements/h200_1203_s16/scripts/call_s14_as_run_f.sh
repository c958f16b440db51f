# Session 14 on one H200: when does a fresh engine in the step's process become slower (after the first update, or
# growing with the steps), and does handing memory back, idling, or freeing every role give its speed back?
# Call 1 (`a`): the bench alone; the step with bench_engine's run before step 1, after steps 1-4, after the steps,
# after empty_cache, after 45 s idle, after the controller's cleanup; the bench alone again.
# Call 2 (`b`): the bench alone; the step (1 warm-up + 1 timed) with bench_engine's run before step 1 and after each
# phase command of step 1 (which phase leaves the device slower), after step 2, with the context's limits and the
# device's clocks during each run; the bench with 20 GiB of pinned host memory held (an offloading trainer's buffers).
# Call 3 (`c`): the update does it (call 2). The bench after a training forward/backward and a fused AdamW step of its
# own model, without and with cudaCtxResetPersistingL2Cache after them; the step with bench_engine's run after the
# steps and again after that reset; the step resetting L2 after every update.
# Call 4 (`d`, for the next session): which part of the update does it. The step (1 warm-up, 1 timed) with the probe
# after step 1's logprob and after its update, one switch at a time; the switch that keeps "after update" at the
# "after logprob" figure names the cause. (`e`: the remaining switches.)
# Call `f` (for the next session, first): has the step's process lost PDL after the compiled update? Each probe also
# on an engine captured without PDL (--probe-pdl-off), after logprob and after update, compiled and not.
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
S="python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --probe-rollout --model-dir /tmp/m15"
step() { local n=$1; shift; mkdir -p $O/$n; run $n ${STEP_S:-170} env OUT=$O/$n $S "$@"; }
case ${1:-a} in
a)
  run a1_bench_plain 60 $G --out $O/a1.json
  STEP_S=420 step a2_step_probes --probe-first --probe-after-steps 1 2 3 4 --probe-release --probe-idle-s 45
  run a3_bench_plain 60 $G --out $O/a3.json ;;
b)
  run b1_bench_plain 60 $G --out $O/b1.json
  run b3_bench_pinned 90 $G --process-state pinned --out $O/b3.json
  STEP_S=400 step b2_step_phases --warmup 1 --steps 1 --probe-first --probe-after-phases wake generate sleep logprob update reshard ;;
c)
  run c1_bench_plain 60 $G --out $O/c1.json
  STEP_S=170 step c4_step_l2probe --warmup 1 --steps 1 --probe-l2-reset
  STEP_S=160 step c5_step_l2reset --warmup 1 --steps 2 --l2-reset-after-update
  run c2_bench_train 80 $G --process-state backward adam --out $O/c2.json
  run c3_bench_train_l2reset 80 $G --process-state backward adam --l2-reset --out $O/c3.json ;;
d)
  P="--warmup 1 --steps 1 --probe-after-phases logprob update"
  STEP_S=140 step d1_nocompile $P --set trainer.compile=false
  STEP_S=140 step d2_unfused_adam $P --set trainer.fused_optimizer=false
  STEP_S=140 step d3_unfused_logprobs $P --set trainer.fused_logprobs=false
  STEP_S=140 step d4_no_offload $P --offload none ;;
e)
  P="--warmup 1 --steps 1 --probe-after-phases logprob update"
  STEP_S=140 step e1_default $P
  STEP_S=140 step e2_no_deferred_sync $P --set trainer.defer_grad_sync=false
  STEP_S=140 step e3_no_grad_clip $P --set trainer.grad_clip=0 ;;
f)
  P="--warmup 1 --steps 1 --probe-after-phases logprob update --probe-pdl-off"
  STEP_S=220 step f1_default_pdl $P
  STEP_S=220 step f2_nocompile_pdl $P --set trainer.compile=false ;;
esac
cd $O && tar czf /tmp/all.tgz . && mv /tmp/all.tgz $O/all.tgz && find . -mindepth 1 \( -name '*.log' -o -name '[a-z]?.json' \) -delete
