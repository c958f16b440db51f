# Session 10, call 4: the step's engine settings while awake, and bench_engine's run inside the step's process
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; mkdir -p $O
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; tail -n 2 $O/$n.log; }
run a_step 300 env OUT=$O python3 tools/bench_step.py --shape 1.5b --device cuda --probe-rollout --model-dir /tmp/m15
