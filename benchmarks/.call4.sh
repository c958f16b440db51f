source benchmarks/gpu_env.sh > /dev/null 2>&1 || exit 1
mkdir -p $OUT/logs
t0=$SECONDS
env HYBRIDRL_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_logprob_kernel.py tests/unit/engines/native/test_engine_blocks.py > $OUT/logs/logprob_kernel.log 2>&1; echo "logprob rc=$? $((SECONDS-t0))s"; tail -n 3 $OUT/logs/logprob_kernel.log
OUT=$OUT/logs bash benchmarks/gpu.sh kernel_engine 2>&1 | grep -E "^== |passed|failed|FAILED|Error" | head -40
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
