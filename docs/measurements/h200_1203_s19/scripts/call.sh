# Session 19 on one H200. Session 18's calls (run at this session's start, in ../../h200_1203_s17/scripts/call.sh):
# `f` (the child process is fast after the steps: the slowdown is the step's process's) and `e` (the bench's own process
# given the actor role's update loses PDL's gain: a reproducer in ~100 s). Call `a` bisects the actor role in the bench:
# the plain bench, the role without compiled layers, the role up to its log-prob pass, the role only loaded, the whole
# role again; each with PDL on and off interleaved. Only the compiled role's update loses the gain. Call `b`: the
# whole role with the context's local memory resized after it (`--stack-reset`), then the eager role again (is call
# a's split repeatable?); two arms only, as the device minutes left allowed.
# Call `c` (for the next session; each arm run on the CPU with the tiny shape): the whole role again (this machine's
# figure), the role with all it kept dropped after its update (`--release-state`: holding or having run?), and the
# role with one inductor setting changed: its mix-order reductions off (a backward-only fusion, the norms' row and
# column reductions in one persistent kernel with a workspace), its Triton kernels launched through Triton's own
# launcher instead of torch's static one, its split reductions off. Call `h`: the bench's own `compile` state
# (compiled layers' forward and backward without FSDP or the role: measured in session 13 before PDL was on/off
# interleaved), and the role with persistent reductions off.
# Call `g VAR=VALUE` (for the next session): the step with an inductor setting from the environment against the step
# as it is (its own generate, and the probe after the steps with PDL on and off).
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
S="python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --model-dir /tmp/m15"
step() { local n=$1 t=$2; shift 2; mkdir -p $O/$n; run $n $t env OUT=$O/$n "$@"; }
B="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 --pdl 1 0 1 0"
case ${1:-a} in
a)
  run a0_plain 100 $B --out $O/a0_plain.json
  for s in actor-eager actor-logprob actor-init actor; do run a_$s 130 $B --process-state $s --out $O/a_$s.json; done ;;
b)
  run b1_stack_reset 120 $B --process-state actor --stack-reset --out $O/b1_stack_reset.json
  run b2_actor-eager 120 $B --process-state actor-eager --out $O/b2_actor-eager.json ;;
c)
  run c0_actor 120 $B --process-state actor --out $O/c0_actor.json
  run c1_released 120 $B --process-state actor --release-state --out $O/c1_released.json
  run c2_no_mix_order 120 env TORCHINDUCTOR_MIX_ORDER_REDUCTION=0 $B --process-state actor --out $O/c2_no_mix_order.json
  run c3_launcher 120 env TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0 $B --process-state actor --out $O/c3_launcher.json
  run c4_no_split 120 env TORCHINDUCTOR_SPLIT_REDUCTIONS=0 $B --process-state actor --out $O/c4_no_split.json ;;
h)
  run h1_compile 110 $B --process-state compile --out $O/h1_compile.json
  run h2_no_persistent 120 env TORCHINDUCTOR_PERSISTENT_REDUCTIONS=0 $B --process-state actor \
    --out $O/h2_no_persistent.json ;;
g)
  # `call.sh g VAR=VALUE`: the step (1 timed step) with that inductor setting, its probe PDL on and off after the
  # steps, e.g. the setting whose `c` arm kept PDL's gain; then the step as it is, for the same machine's figure.
  step g1_setting 260 env "$2" $S --probe-rollout --warmup 1 --steps 1 --probe-pdl-off
  step g2_default 260 $S --probe-rollout --warmup 1 --steps 1 --probe-pdl-off ;;
esac
grep -h "^probe" $O/*.log 2>/dev/null
for f in $O/*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))['grpo']['pdl_variants']
print(sys.argv[1].split('/')[-1], {k: round(v['tokens_per_s']) for k, v in d.items()})" $f; done
cd $O && tar czf /tmp/all.tgz . && mv /tmp/all.tgz $O/all.tgz && find . -mindepth 1 -name '*.log' -delete
