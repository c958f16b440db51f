# Session 11, call 1: the step with the engine never releasing its memory (sleep_level=0) against the default; the bench plain and after wakes into 64 MiB holes
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; mkdir -p $O/level0 $O/default
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -E '"(tokens_per_s|rollout_tokens_per_s|decode_step_ms|step_s_median|switching_share)"' $O/$n.log | head -6; }
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
run f_step_level0 170 env OUT=$O/level0 python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --set engine.sleep_level=0
run g_step_default 170 env OUT=$O/default python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1
run a_plain 70 $G --out $O/a_plain.json
run b_frag 90 $G --sleep-cycle allx64 --out $O/b_frag.json
cd $O && tar czf all.tgz --exclude=all.tgz . && find . -mindepth 1 ! -name all.tgz -delete; ls -la $O
