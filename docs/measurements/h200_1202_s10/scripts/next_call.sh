# Planned for the next session (not run yet): is the engine's memory mapped into pieces what slows the step's rollout?
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; mkdir -p $O/level0 $O/default
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -E '"(tokens_per_s|rollout_tokens_per_s|decode_step_ms)"' $O/$n.log | head -3; }
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
run a_plain 70 $G --out $O/a_plain.json                        # a device nothing else used
run b_frag 90 $G --sleep-cycle allx64 --out $O/b_frag.json     # every run after a wake into 64 MiB holes
run c_plain 70 $G --out $O/c_plain.json
run d_frag 90 $G --sleep-cycle allx64 --out $O/d_frag.json
run e_live 70 $G --live-gb 60 --out $O/e_live.json             # a trainer's footprint, in one piece
run f_step_level0 190 env OUT=$O/level0 python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --set engine.sleep_level=0
run g_step_default 190 env OUT=$O/default python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1
