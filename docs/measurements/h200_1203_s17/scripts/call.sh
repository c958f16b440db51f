# Session 17 on one H200: is the completion trigger (kernels/pdl.py mode 2) the fix for the PDL engines' slowdown
# after the first update (session 16, call b)? Helpers as in ../../h200_1203_s16/scripts/call.sh.
# Call `a`: the GPU tests of the completion trigger; the step's probes after logprob and after the update on three
# engines (PDL as now, without PDL, PDL triggered at completion) = session 16's `call.sh d`; the plain GRPO bench with
# PDL on/off and start/completion triggers = session 16's `c1`.
# Call `b` (as run, inline): the bench's own process given the product's FSDP2 update, the same without the optimizer
# step, one one-rank NCCL AVG all-reduce (session 16's `c2`-`c4`), each with PDL on and off interleaved.
# Call `c`: the step's probes (PDL on and off) after logprob and after the update, with the trainer's state kept on the
# device (`--offload none`) and with the offloaded memory freed at once (`--eager-offload`).
# Call `d` (for the next session; the overrides checked on the CPU with the tiny shape): the same probes with one part of
# the actor's update changed at a time: no reference and no KL term (`algorithm.kl_coef=0`), four micro-batches of 64
# instead of sixteen of 16, no gradient clip. Whichever keeps PDL's gain after the update names the part to look into.
# Call `f` (written in session 18, which had no device time; checked on the CPU with the tiny shape): the step's probes
# with bench_engine also run in a process of its own, PDL on and off, before step 1 and after the steps while the step's
# process holds its roles (`--probe-subprocess`). A child as slow after the steps as the in-process probe puts the
# slowdown in the device; a child as fast as before step 1 puts it in the step's process. One run answers what `d` and
# `e` narrow down, so run it first (~6 minutes).
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; tail -3 $O/$n.log; }
G="python3 tools/bench_engine.py --case grpo"
B="$G --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 --pdl 1 0 1 0"
T="--pdl-trigger start completion start completion"
S="python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --model-dir /tmp/m15"
step() { local n=$1 t=$2; shift 2; mkdir -p $O/$n; run $n $t env OUT=$O/$n $S "$@"; }
case ${1:-a} in
a)
  run a1_tests 100 env HYBRIDRL_TEST_DEVICE=cuda python3 -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/test_engine_kernels.py tests/test_fused_engine.py -k pdl
  step a2_step_arms 250 --probe-rollout --warmup 1 --steps 1 --probe-after-phases logprob update --probe-pdl-off \
    --probe-pdl-completion
  run a3_plain 120 $B $T --out $O/a3_plain.json ;;
b)
  for s in fsdp nccl-avg fsdp-backward; do run b_$s 170 $B --process-state $s --out $O/b_$s.json; done ;;
c)
  P="--probe-rollout --warmup 1 --steps 1 --probe-after-phases logprob update --probe-pdl-off"
  step c1_offload_none 215 $P --offload none
  step c2_eager_offload 215 $P --eager-offload ;;
d)
  P="--probe-rollout --warmup 1 --steps 1 --probe-after-phases logprob update --probe-pdl-off"
  step d1_no_kl 190 $P --set algorithm.kl_coef=0
  step d2_micro64 190 $P --set trainer.micro_batch_size=64
  step d3_no_clip 190 $P --set trainer.grad_clip=0 ;;
e)
  run e0_plain 110 $B --out $O/e0_plain.json
  run e1_actor 260 $B --process-state actor --out $O/e1_actor.json ;;
f)
  step f1_child 480 --probe-rollout --warmup 1 --steps 1 --probe-first --probe-pdl-off --probe-subprocess ;;
esac
grep -h "^probe" $O/*.log 2>/dev/null
cd $O && tar czf /tmp/all.tgz . && mv /tmp/all.tgz $O/all.tgz && find . -mindepth 1 -name '*.log' -delete
