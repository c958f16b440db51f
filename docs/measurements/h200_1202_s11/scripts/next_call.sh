# Planned for the next session (not run yet), two calls (`bash next_call.sh a`, then `b`): what in the step's process
# makes the same decode graphs 1.4-2.8% slower on the device? The profiler's kernel times were the same in both
# processes (call 3), so what differs is between the kernels of a graph, which programmatic dependent launch (PDL)
# overlaps. Two suspects: PDL itself gaining less there, and what torch.compile (trainer.compile, on by default on
# GPU; the bench never imports inductor) leaves in the process.
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
S="python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --probe-rollout --model-dir /tmp/m15"
step() { local n=$1; shift; mkdir -p $O/$n; run $n 170 env OUT=$O/$n $S "$@"; }
if [[ ${1:-a} == a ]]; then
  run a_bench_pdl 100 python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 --pdl 1 0 1 0 1 --out $O/a_bench_pdl.json
  step b_step_default
  step c_step_no_compile --set trainer.compile=false
else
  step d_step_no_pdl --set engine.native.pdl=false
  step e_step_no_pdl_no_compile --set engine.native.pdl=false --set trainer.compile=false
fi
cd $O && tar czf /tmp/all.tgz . && mv /tmp/all.tgz $O/all.tgz && find . -mindepth 1 -name '*.log' -delete
