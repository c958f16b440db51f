# Session 9, call 5 (run from the repo root on the device); results straight into $OUT
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
timeout 100 python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512 --wave-split 1 0 1 0 1 --out $OUT/o_grpo_wave_split.json > $OUT/o_grpo_wave_split.log 2>&1; echo "grpo rc=$?"
WS=$(python3 -c "
import json
v=json.load(open('$OUT/o_grpo_wave_split.json'))['grpo']['wave_split_variants']
print(1 if v['True']['tokens_per_s'] > v['False']['tokens_per_s'] else 0)" 2>/dev/null || echo 1)
echo "wave split for the step: $WS"
mkdir -p /tmp/p
timeout 150 env OUT=/tmp/p python3 tools/bench_step.py --shape 1.5b --device cuda --set engine.native.gemm_wave_split=$WS > $OUT/p_step.log 2>&1; echo "step rc=$?"
cp /tmp/p/*.json $OUT/ 2>/dev/null
grep -h '"tokens_per_s"\|rollout_tokens_per_s\|step_s_median' $OUT/o_grpo_wave_split.json $OUT/*step*.json 2>/dev/null | head
