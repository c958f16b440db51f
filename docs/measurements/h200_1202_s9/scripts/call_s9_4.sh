# Session 9, call 4 (run from the repo root on the device)
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=/tmp/o; mkdir -p $O
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; tail -n 2 $O/$n.log; }
run k_tests 70 env HYBRIDRL_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_sampling_kernel.py tests/test_engine_sampling.py tests/test_fused_engine.py -k "noise or draws or kernel or pdl or graphs_match or exponential"
run l_sampler 80 python3 tools/bench_decode_kernels.py --what sampler --sampler-baseline scratch_dev/sampling_triton_s9_pdl.py  # = git show 10fcc21:hybridrl/engines/sampling_triton.py --out $O/l_sampler.json
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
run m_kv16 60 $G --kv-block-size 16 --out $O/m_kv16.json
run m_kv64 60 $G --kv-block-size 64 --out $O/m_kv64.json
run m_kv32 60 $G --kv-block-size 32 --out $O/m_kv32.json
BS=$(python3 -c "
import json
t={b: json.load(open('$O/m_kv%d.json'%b))['grpo']['tokens_per_s'] for b in (16,32,64)}
best=max(t,key=t.get); print(best if t[best] > 1.01*t[16] else 16)" 2>/dev/null || echo 16)
echo "step block size $BS"
mkdir -p $O/n
run n_step 170 env OUT=$O/n python3 tools/bench_step.py --shape 1.5b --device cuda --set engine.native.kv_block_size=$BS
cd /tmp && tar czf $OUT/o.tgz o
