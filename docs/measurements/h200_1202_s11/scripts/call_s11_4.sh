# Session 11, call 4: does memory the process holds (a trainer's footprint, in one piece) slow the bench's rollout?
# Plain and --live-gb 60 alternating, each in a process of its own, one machine
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
for n in a_plain b_live60 c_plain d_live60; do
  extra=""; [[ $n == *live60 ]] && extra="--live-gb 60"
  timeout 80 $G $extra --out $O/$n.json > /dev/null 2>&1; echo "== $n rc=$?"
  python3 -c "import json; g=json.load(open('$O/$n.json'))['grpo']; print('$n', round(g['tokens_per_s']), round(g['decode_step_ms'],4), round(g['launch_timing']['busy_ms_median'],4))"
done
