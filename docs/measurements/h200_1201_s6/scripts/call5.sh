#!/usr/bin/env bash
# Device call 5 (session 6): packed row state (one H2D per join, one gather per compaction), pinned output ring.
source tools/gpu_env.sh > $OUT/env.log 2>&1 || { cat $OUT/env.log; exit 1; }
export PYTHONUNBUFFERED=1
HYBRIDRL_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_engine_scheduler.py \
  tests/test_fused_engine.py > $OUT/i_tests.log 2>&1; echo "tests rc=$?" >> $OUT/i_tests.log; tail -2 $OUT/i_tests.log
MT="python3 tools/bench_engine.py --case multiturn --shape 0.5b --turns 4 --tool-ms 50 --skip-hf --join-wait 0"
timeout 150 $MT --trajectories 512 --max-rows 256 --new-tokens 256 --join-step-tokens 0 512 \
  --out $OUT/j_bench_engine_0.5b_multiturn_512on256x4.json > $OUT/j.log 2>&1; echo "j rc=$?"
timeout 100 $MT --trajectories 256 --new-tokens 256 --join-step-tokens 0 512 \
  --out $OUT/k_bench_engine_0.5b_multiturn_256x4.json > $OUT/k.log 2>&1; echo "k rc=$?"
timeout 120 python3 docs/measurements/h200_1201_s6/scripts/gpu_hostprof.py 512 > $OUT/l_hostprof.txt 2>&1; head -4 $OUT/l_hostprof.txt
python3 docs/measurements/h200_1201_s6/scripts/summary.py $OUT/[jk]_*.json
cd $OUT && tar czf all.tgz *.log *.json *.txt && ls
