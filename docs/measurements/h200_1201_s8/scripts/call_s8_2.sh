# Session 8, call 2 (run from the repo root on the device)
set -u
source tools/gpu_env.sh >/dev/null 2>&1
O=/tmp/o; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; tail -n 6 $O/$n.log; }
run a_tests 150 env HYBRIDRL_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_sampling_kernel.py tests/test_engine_sampling.py tests/test_engine_kernels.py tests/test_fused_engine.py -k "sampl or split or fixed or survive or long or exponential or negligible"
run b_split_sweep 90 env OUT=$O python3 scratch_dev/split_sweep.py
run c_sampler 90 python3 tools/bench_decode_kernels.py --what sampler --shapes 1.5b --sampler-baseline scratch_dev/sampling_triton_prev.py --out $O/c_sampler.json
run d_grpo_new 120 python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 --long-keys 320 0 --out $O/d_grpo_new.json
cp hybridrl/engines/sampling_triton.py /tmp/new_sampler.py; cp scratch_dev/sampling_triton_prev.py hybridrl/engines/sampling_triton.py
run e_grpo_oldsampler 120 python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 --long-keys 320 0 --out $O/e_grpo_oldsampler.json
cp /tmp/new_sampler.py hybridrl/engines/sampling_triton.py
run f_step 200 env OUT=$O/f python3 tools/bench_step.py --shape 1.5b --device cuda
cd /tmp && tar czf $OUT/o.tgz o
