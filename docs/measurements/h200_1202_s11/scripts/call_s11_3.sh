# Session 11, call 3: which kernels are slower inside the step's process: profiler tables of one warm GRPO run in the
# bench's own process and of the same run on a fresh engine inside the step's process (after its steps)
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; mkdir -p $O/step
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
run a_bench 90 $G --out $O/a_bench.json --profile $O/a_bench_profile.txt
run b_probe 200 env OUT=$O/step python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --steps 2 --warmup 1 --probe-rollout --model-dir /tmp/m15 --probe-profile $O/b_here_profile.txt
head -c 6000 $O/a_bench_profile.txt; echo; head -c 6000 $O/b_here_profile.txt
python3 -c "
import json,glob
g=json.load(open('$O/a_bench.json'))['grpo']; print('bench', g['tokens_per_s'], g['launch_timing']['busy_ms_median'])
for f in glob.glob('$O/step/*.json'):
    p=json.load(open(f))['rollout_probe']; h=p['bench_engine_here']; print('here', h['tokens_per_s'], h['launch_timing']['busy_ms_median'], [l['busy_ms_median'] for l in p['engine_direct_launches']])
"
cd $O && tar czf /tmp/all.tgz . && mv /tmp/all.tgz $O/all.tgz && find . -mindepth 1 -name '*.log' -delete
