# Session 10, call 3: does a sleep/wake cycle between rollouts (as the step has) slow the next rollout?
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; mkdir -p $O
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; tail -n 2 $O/$n.log; }
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
run a_cycle 200 $G --sleep-cycle-gb -1 0 40 -1 0 40 --out $O/a_cycle.json
nvidia-smi -q -d PAGE_RETIREMENT,ROW_REMAPPER 2>/dev/null | head -30 > $O/smi.txt
