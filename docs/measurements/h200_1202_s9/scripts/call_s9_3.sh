# Session 9, call 3 (run from the repo root on the device)
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=/tmp/o; mkdir -p $O
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; tail -n 3 $O/$n.log; }
run g_tests 150 env HYBRIDRL_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_engine_kernels.py tests/test_sampling_kernel.py tests/test_fused_engine.py -k "pdl or triton or graph or survive or sampl or fixed"
run h_grpo_pdl 150 python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 --pdl 1 0 1 0 1 --out $O/h_grpo_pdl.json
mkdir -p $O/i
run i_step 170 env OUT=$O/i python3 tools/bench_step.py --shape 1.5b --device cuda
run j_single 90 python3 tools/bench_engine.py --case single --shape 0.5b --batch 64 --new-tokens 256 --skip-hf --out $O/j_single.json
cd /tmp && tar czf $OUT/o.tgz o
