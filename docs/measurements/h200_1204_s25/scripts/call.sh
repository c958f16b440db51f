# Session 25 on one H200: the confirming figures for issue 21 under the default engine.native.pdl=auto.
# `g`: the 0.5B single case (batch 64 x 256 new) under auto, on and off, each in its own process; the 1.5B GRPO bench
# with auto's plain graphs captured first (`--pdl-trial-first off`) beside fixed on and off.
# `h`: multi-turn as session 21's `y_` ran it (512 trajectories on 256 rows, 4 turns, 50 ms tool, join wait 0 and 8)
# under auto and under on (the former default), each in its own process.
# `j`: PDL off with its graph's pool laid out as auto's, or shifted by a pad (scripts/layout.py).
# `k`: auto with its choice forced from the first step (scripts/forced.py).
# `l`: the plain decode graphs with the switch on or off inside and outside the decode launches (scripts/pin.py).
# `i`: the GRPO bench with the modes in other orders in one process (is the last variant slow whatever its mode?).
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
B="tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
M="tools/bench_engine.py --case multiturn --shape 0.5b --trajectories 512 --max-rows 256 --turns 4 --tool-ms 50 --new-tokens 256 --join-wait 0 8"
case ${1:-g} in
g)
  for m in auto on off; do
    run g1_single_$m 120 python3 tools/bench_engine.py --case single --shape 0.5b --batch 64 --new-tokens 256 \
      --skip-hf --pdl $m --out $O/g1_single_$m.json
  done
  run g2_grpo_plain_first 150 python3 $B --pdl auto on off --pdl-trial-first off --out $O/g2_grpo_plain_first.json ;;
h)
  for m in auto on; do run h_multiturn_$m 250 python3 $M --pdl $m --out $O/h_multiturn_$m.json; done ;;
i)  # is a variant slow for being the process's last? The GRPO bench with the three modes in the other orders
  run i1_grpo_off_on_auto 150 python3 $B --pdl off on auto --out $O/i1_grpo_off_on_auto.json
  run i2_grpo_on_auto_off 150 python3 $B --pdl on auto off --out $O/i2_grpo_on_auto_off.json
  run i3_grpo_off_auto_on 150 python3 $B --pdl off auto on --out $O/i3_grpo_off_auto_on.json ;;
j)  # is it where the graph's activations lie? One engine, arms in turn (scripts/layout.py)
  run j_layout 400 python3 docs/measurements/h200_1204_s25/scripts/layout.py $O/j_layout.json ;;
k)  # auto with its choice forced from the first step, beside off, on and auto (scripts/forced.py)
  run k_forced 400 python3 docs/measurements/h200_1204_s25/scripts/forced.py $O/k_forced.json ;;
l)  # the decode graphs forced plain, the switch set apart inside and outside the decode launches (scripts/pin.py)
  run l_pin 400 python3 docs/measurements/h200_1204_s25/scripts/pin.py $O/l_pin.json ;;
m)  # pin.py as changed after call l: the switch set apart for the prefill; a tiny PDL graph held with the switch off
  run m_pin 400 python3 docs/measurements/h200_1204_s25/scripts/pin.py $O/m_pin.json ;;
esac
for f in $(ls $O/[ghi]*.json 2>/dev/null); do python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); c=next(iter(k for k in d if k in ('single','grpo','multiturn')))
r=d[c]; print(sys.argv[1].split('/')[-1], c, {k: v for k, v in r.items() if isinstance(v, (int, float, str))})
print('  parity', r.get('parity')); print('  variants', {k: round(v.get('tokens_per_s', 0)) for k, v in r.get('pdl_mode_variants', {}).items()})" $f; done
cd $O && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz $O/all.tgz
