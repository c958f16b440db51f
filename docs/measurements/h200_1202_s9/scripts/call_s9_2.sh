# Session 9, call 2 (run from the repo root on the device)
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=/tmp/o; mkdir -p $O
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; tail -n 3 $O/$n.log; }
run d_tests 70 env HYBRIDRL_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_engine_kernels.py tests/test_fused_engine.py -k "pdl or prefetch or norms or graphs_match"
run e_grpo_prefetch 200 python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 --prefetch qkv,down none qkv qkv,down,gate_up none qkv qkv,down,gate_up qkv,down --out $O/e_grpo_prefetch.json
mkdir -p $O/f
run f_step 200 env OUT=$O/f python3 tools/bench_step.py --shape 1.5b --device cuda
cd /tmp && tar czf $OUT/o.tgz o
