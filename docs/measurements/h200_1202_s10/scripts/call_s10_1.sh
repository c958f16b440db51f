# Session 10, call 1 (run from the repo root on the device): the in-step rollout gap, probed
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; mkdir -p $O
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; tail -n 2 $O/$n.log; }
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
run a_grpo 90 $G --out $O/a_grpo.json
mkdir -p $O/b
run b_step 240 env OUT=$O/b python3 tools/bench_step.py --shape 1.5b --device cuda --probe-rollout
run c_grpo 90 $G --out $O/c_grpo.json
