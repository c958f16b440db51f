source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=/tmp/o; mkdir -p $O
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1
timeout 150 env HYBRIDRL_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rf tests/test_sampling_kernel.py tests/test_engine_sampling.py tests/test_engine_kernels.py tests/test_fused_engine.py -k "sampl or split or fixed or survive or long or exponential or negligible" > $O/k_tests.log 2>&1; echo rc=$?
tail -n 8 $O/k_tests.log
cp $O/k_tests.log $OUT/
