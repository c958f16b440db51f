# Session 11, call 5: is the rollout slower on a device just heated by full-power GEMMs (as after a training phase)?
# The bench plain and after --heat-s 45, alternating, each in a process of its own; nvidia-smi logs GPU and HBM
# temperature, clocks and power every 0.5 s meanwhile
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
nvidia-smi --query-gpu=timestamp,temperature.gpu,temperature.memory,clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active --format=csv -lms 500 > $O/smi.csv 2>&1 &
SMI=$!
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
for n in a_plain b_heat45 c_plain d_heat45; do
  extra=""; [[ $n == *heat45 ]] && extra="--heat-s 45"
  echo "$(date +%T) start $n" >> $O/marks.txt
  timeout 100 $G $extra --out $O/$n.json > /dev/null 2>&1; echo "== $n rc=$?"
  echo "$(date +%T) end $n" >> $O/marks.txt
  python3 -c "import json; g=json.load(open('$O/$n.json'))['grpo']; print('$n', round(g['tokens_per_s']), round(g['decode_step_ms'],4), round(g['launch_timing']['busy_ms_median'],4), g['device_state'])"
done
kill $SMI; cat $O/marks.txt; awk 'NR%4==1' $O/smi.csv | tail -n 200 | head -c 9000
