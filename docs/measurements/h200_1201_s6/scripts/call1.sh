#!/usr/bin/env bash
# Device call 1 (session 6): joins inside the step — CUDA tests, then the multi-turn A/B in one process each.
source tools/gpu_env.sh > $OUT/env.log 2>&1 || { cat $OUT/env.log; exit 1; }
nvidia-smi -L > $OUT/gpu.txt
export PYTHONUNBUFFERED=1
HYBRIDRL_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_engine_scheduler.py \
  tests/test_fused_engine.py > $OUT/a_tests.log 2>&1; echo "tests rc=$?" >> $OUT/a_tests.log; tail -3 $OUT/a_tests.log
timeout 220 python3 tools/bench_engine.py --case multiturn --shape 0.5b --trajectories 512 --max-rows 256 --turns 4 \
  --tool-ms 50 --new-tokens 256 --join-wait 0 2 8 --join-step-tokens 0 512 --skip-hf \
  --out $OUT/b_bench_engine_0.5b_multiturn_512on256x4.json > $OUT/b.log 2>&1; echo "b rc=$?"
timeout 150 python3 tools/bench_engine.py --case multiturn --shape 0.5b --trajectories 256 --turns 4 \
  --tool-ms 50 --new-tokens 256 --join-wait 0 8 --join-step-tokens 0 512 --skip-hf \
  --out $OUT/c_bench_engine_0.5b_multiturn_256x4.json > $OUT/c.log 2>&1; echo "c rc=$?"
python3 docs/measurements/h200_1201_s6/scripts/summary.py $OUT/[bc]_*.json
cd $OUT && tar czf all.tgz *.log *.json *.txt && ls
