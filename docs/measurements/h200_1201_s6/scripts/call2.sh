#!/usr/bin/env bash
# Device call 2 (session 6): + deferral past the step budget, join wait 0 default, host-wait column.
source tools/gpu_env.sh > $OUT/env.log 2>&1 || { cat $OUT/env.log; exit 1; }
export PYTHONUNBUFFERED=1
HYBRIDRL_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_engine_scheduler.py \
  tests/test_fused_engine.py > $OUT/d_tests.log 2>&1; echo "tests rc=$?" >> $OUT/d_tests.log; tail -3 $OUT/d_tests.log
MT="python3 tools/bench_engine.py --case multiturn --shape 0.5b --turns 4 --tool-ms 50 --skip-hf --join-wait 0"
timeout 200 $MT --trajectories 512 --max-rows 256 --new-tokens 256 --join-step-tokens 0 512 1024 \
  --out $OUT/e_bench_engine_0.5b_multiturn_512on256x4.json > $OUT/e.log 2>&1; echo "e rc=$?"
timeout 200 $MT --trajectories 512 --max-rows 256 --new-tokens 1024 --join-step-tokens 0 512 \
  --out $OUT/f_bench_engine_0.5b_multiturn_512on256x4_n1024.json > $OUT/f.log 2>&1; echo "f rc=$?"
timeout 120 $MT --trajectories 256 --new-tokens 256 --join-step-tokens 0 512 \
  --out $OUT/g_bench_engine_0.5b_multiturn_256x4.json > $OUT/g.log 2>&1; echo "g rc=$?"
python3 docs/measurements/h200_1201_s6/scripts/summary.py $OUT/[efg]_*.json
cd $OUT && tar czf all.tgz *.log *.json && ls
