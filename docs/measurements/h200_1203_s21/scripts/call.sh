# Session 21 on one H200. Call 1 ran ../../h200_1203_s20/scripts/call.sh b (b3, b4), call 2 `mlp_split.py` (this
# folder), call 3 this script: where the GRPO bench's decode step goes now (the profiler's table over one warm
# 32 × 8 × 512 rollout), the step as issue 21 measures it (bench_step's defaults: 2 warm-up and 3 timed steps,
# offload params,optimizer), then the bench again on the same machine.
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
run c1_grpo_profile 200 $G --profile $O/c1_profile_grpo_1.5b.txt --out $O/c1_grpo.json
mkdir -p $O/c2_step
run c2_step 330 env OUT=$O/c2_step python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --model-dir /tmp/m15
run c3_grpo 150 $G --out $O/c3_grpo.json
grep -h "tok/s\|rollout_tokens_per_s\|step_s_median" $O/*.log | head -20
