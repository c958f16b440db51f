# Session 9, call 1 (run from the repo root on the device)
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=/tmp/o; mkdir -p $O
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; tail -n 4 $O/$n.log; }
python3 -c "import triton, torch; from hybridrl.engines.kernels import pdl; print('triton', triton.__version__, 'gdc', pdl.HAS_GDC, 'capable', pdl.capable(torch.device('cuda')))"
run a_tests 100 env HYBRIDRL_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_engine_kernels.py tests/test_sampling_kernel.py tests/test_fused_engine.py -k "pdl or triton or graph or survive or sampl"
run b_grpo_pdl 200 python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 --pdl 1 0 1 0 1 --out $O/b_grpo_pdl.json
run c_gemm 80 python3 scratch_dev/gemm_layouts.py $O/c_gemm.json
cd /tmp && tar czf $OUT/o.tgz o
