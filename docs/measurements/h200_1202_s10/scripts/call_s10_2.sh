# Session 10, call 2: the step's own weights in the engine bench; the probe with the prefill split out
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; mkdir -p $O
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; tail -n 2 $O/$n.log; }
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
mkdir -p $O/a
run a_step 240 env OUT=$O/a python3 tools/bench_step.py --shape 1.5b --device cuda --probe-rollout --model-dir /tmp/m15
run b_grpo_hf 90 $G --out $O/b_grpo_hf.json
run c_grpo_stepw 90 $G --model-dir /tmp/m15 --out $O/c_grpo_stepw.json
run d_grpo_hf 90 $G --out $O/d_grpo_hf.json
run e_grpo_stepw 90 $G --model-dir /tmp/m15 --out $O/e_grpo_stepw.json
