# Session 8, call 3 (run from the repo root on the device)
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=/tmp/o; mkdir -p $O
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; tail -n 4 $O/$n.log; }
run g_tests 120 env HYBRIDRL_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_sampling_kernel.py tests/test_engine_sampling.py tests/test_engine_kernels.py tests/test_fused_engine.py -k "sampl or split or fixed or survive or long or exponential or negligible or graph or attention"
run h_grpo_ab 120 python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 --long-keys auto 0 auto 0 --out $O/h_grpo_ab.json
mkdir -p $O/i $O/j
run i_step_auto 170 env OUT=$O/i python3 tools/bench_step.py --shape 1.5b --device cuda
run j_step_nosplit 170 env OUT=$O/j python3 scratch_dev/step_long_keys.py 0 --shape 1.5b --device cuda
grep -h PATCHED $O/j_step_nosplit.log
cd /tmp && tar czf $OUT/o.tgz o
