# Session 24 on one H200. `a`: is PDL's lost gain after the compiled update the SM's L1/shared carveout being
# reconfigured between the decode graph's kernels? The bench's reproducer (the product's actor role and its compiled
# update in the bench's process, then the engine; PDL on and off interleaved), as it is and with the carveout fixed
# three ways (scripts/carveout.py). As run, the bench's flag was `--pdl 1 0 1 0` (its values are on/off/auto now).
# `b`, `c`: engine.native.pdl=auto (fused/launch_choice.py): its CUDA tests, the reproducer and the plain bench with
# auto, on and off, and the step as issue 21 measures it with auto and with PDL on, alternating. `g`: not run yet.
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
step() { local n=$1 t=$2; shift 2; mkdir -p $O/$n; run $n $t env OUT=$O/$n "$@"; }
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
C="python3 docs/measurements/h200_1204_s24/scripts/carveout.py"
B="tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
S="tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --model-dir /tmp/m15"
case ${1:-a} in
a)
  run a1_actor 140 $C none $B --pdl on off on off --process-state actor --out $O/a1_actor.json
  run a2_actor_ours100 140 $C ours=100 $B --pdl on off on off --process-state actor --out $O/a2_actor_ours100.json
  run a3_actor_ctxshared 140 $C ctx-shared $B --pdl on off on off --process-state actor --out $O/a3_actor_ctxshared.json
  run a4_actor_all100 140 $C all=100 $B --pdl on off on off --process-state actor --out $O/a4_actor_all100.json ;;
b)  # engine.native.pdl=auto (the decode graphs captured both ways, the faster kind kept after each wake-up): its CUDA
    # tests; the bench's reproducer with auto, on and off; the step with auto (the default now), then with PDL on
  run b0_tests 120 env HYBRIDRL_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/test_launch_choice.py tests/test_fused_engine.py -k "pdl or graphed or split_graphs"
  run b1_actor_auto 130 python3 $B --process-state actor --pdl auto on off --out $O/b1_actor_auto.json
  step b2_step_auto 200 python3 $S
  step b3_step_on 200 python3 $S --set engine.native.pdl=on ;;
c)  # the step with on, then auto (the other order); the plain bench with auto, on and off; the step with PDL off
  step c1_step_on 200 python3 $S --set engine.native.pdl=on
  step c2_step_auto 200 python3 $S
  run c3_grpo_auto 110 python3 $B --pdl auto on off --out $O/c3_grpo_auto.json
  step c4_step_off 200 python3 $S --set engine.native.pdl=off ;;
d)  # auto's two kinds of graph timed over a whole rollout (254 pairs, one at each length), in the plain bench and in
    # the actor reproducer, beside the fixed kinds
  run d1_grpo_trial 120 python3 $B --pdl auto on off --pdl-trial-pairs 254 --out $O/d1_grpo_trial.json
  run d2_actor_trial 140 python3 $B --pdl auto on off --pdl-trial-pairs 254 --process-state actor \
    --out $O/d2_actor_trial.json ;;
g)  # for the next session (not run): the 0.5B single case and the multi-turn case under each pdl mode (each in its own
    # process), and the 1.5B GRPO bench with auto's first capture swapped (plain graphs captured first): does the
    # graph captured second run faster whichever kind it is?
  for m in auto on off; do
    run g1_single_$m 120 python3 tools/bench_engine.py --case single --shape 0.5b --batch 64 --new-tokens 256 \
      --skip-hf --pdl $m --out $O/g1_single_$m.json
  done
  run g2_grpo_plain_first 120 python3 $B --pdl auto on off --pdl-trial-first off --out $O/g2_grpo_plain_first.json
  for m in auto on; do
    run g3_multiturn_$m 150 python3 tools/bench_engine.py --case multiturn --shape 0.5b --pdl $m \
      --out $O/g3_multiturn_$m.json
  done ;;
esac
grep -h "carveout\|cuCtx" $O/*.log 2>/dev/null | sort | uniq -c | sort -rn | head -40
for f in $O/*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))['grpo']
print(sys.argv[1].split('/')[-1], round(d['tokens_per_s']), d.get('pdl_verdict'), {k: round(v['tokens_per_s']) for k, v in d.get('pdl_variants', d.get('pdl_mode_variants', {})).items()})" $f 2>/dev/null; done
for f in $O/*/bench_step*.json; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print(sys.argv[1].split('/')[-2], 'rollout', round(d['rollout_tokens_per_s']), 'step', round(d['step_s_median'], 3), 'switching', round(d['switching_share'], 4),
      [(m.get('engine/pdl'), round(m.get('engine/pdl_gain', 0), 4), round(m.get('time/generate', 0), 3)) for m in d['per_step']])" $f 2>/dev/null; done
tail -2 $O/b0_tests.log 2>/dev/null
cd $O && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz $O/all.tgz
