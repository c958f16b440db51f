# Planned for the next session (not run yet), two calls (`bash next_call.sh a`, then `b`): what in the step's process
# makes the same decode graphs 1.4-2.8% slower on the device? The profiler's kernel times were the same in both
# processes (call 3), so what differs is between the kernels of a graph, which programmatic dependent launch (PDL)
# overlaps. Suspects: what the step's process has and the bench's has not -- the workers' NCCL group and the trainer's
# torch.compile (trainer.compile, on by default on GPU) -- and PDL itself gaining less there.
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
S="python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --probe-rollout --model-dir /tmp/m15"
step() { local n=$1; shift; mkdir -p $O/$n; run $n 170 env OUT=$O/$n $S "$@"; }
if [[ ${1:-a} == a ]]; then  # the bench given the step's process state piece by piece (each its own process), the step
  run a1_bench_plain 60 $G --out $O/a1.json
  run a2_bench_nccl 60 $G --process-state nccl --out $O/a2.json
  run a3_bench_compile 90 $G --process-state compile --out $O/a3.json
  run a4_bench_nccl_compile 90 $G --process-state nccl compile --out $O/a4.json
  run a5_bench_plain 60 $G --out $O/a5.json
  step b_step_default
else  # the step without compile, without PDL
  step c_step_no_compile --set trainer.compile=false
  step d_step_no_pdl --set engine.native.pdl=false
  step e_step_no_pdl_no_compile --set engine.native.pdl=false --set trainer.compile=false
fi
cd $O && tar czf /tmp/all.tgz . && mv /tmp/all.tgz $O/all.tgz && find . -mindepth 1 \( -name '*.log' -o -name 'a?.json' \) -delete
