# Planned for the next session (not run yet): does programmatic dependent launch gain less inside the step's process?
# The profiler's kernel times were the same in both processes (call 3) while the un-profiled launches were 1.4-2.8%
# longer in the step's: what differs is between the kernels of a graph, and PDL is what overlaps them.
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; mkdir -p $O/pdl_on $O/pdl_off
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
run a_bench_pdl 100 python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 --pdl 1 0 1 0 1 --out $O/a_bench_pdl.json
run b_step_pdl_on 200 env OUT=$O/pdl_on python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --probe-rollout --model-dir /tmp/m15
run c_step_pdl_off 200 env OUT=$O/pdl_off python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --probe-rollout --model-dir /tmp/m15 --set engine.native.pdl=false
cd $O && tar czf /tmp/all.tgz . && mv /tmp/all.tgz $O/all.tgz && find . -mindepth 1 -name '*.log' -delete
