# Session 10, call 6: the step with engine.native.compact_wake on (default) and off, one machine
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; mkdir -p $O/on $O/off
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -E '"(rollout_tokens_per_s|step_s_median|switching_share)"' $O/$n.log; }
run a_step_on 200 env OUT=$O/on python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --model-dir /tmp/m15
run b_step_off 200 env OUT=$O/off python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --model-dir /tmp/m15 --set engine.native.compact_wake=false
