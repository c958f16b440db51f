#!/usr/bin/env bash
# Device call 6 (session 6): the example at 256-token turns; 512 on 256 again; CUDA tests of the kernels.
source tools/gpu_env.sh > $OUT/env.log 2>&1 || { cat $OUT/env.log; exit 1; }
export PYTHONUNBUFFERED=1
MT="python3 tools/bench_engine.py --case multiturn --shape 0.5b --turns 4 --tool-ms 50 --skip-hf --join-wait 0"
timeout 150 $MT --trajectories 256 --new-tokens 1024 --join-step-tokens 0 512 \
  --out $OUT/m_bench_engine_0.5b_multiturn_256x4_n1024.json > $OUT/m.log 2>&1; echo "m rc=$?"
timeout 200 $MT --trajectories 512 --max-rows 256 --new-tokens 1024 --join-step-tokens 0 512 \
  --out $OUT/n_bench_engine_0.5b_multiturn_512on256x4_n1024.json > $OUT/n.log 2>&1; echo "n rc=$?"
timeout 120 $MT --trajectories 512 --max-rows 256 --new-tokens 256 --join-step-tokens 0 512 \
  --out $OUT/o_bench_engine_0.5b_multiturn_512on256x4.json > $OUT/o.log 2>&1; echo "o rc=$?"
python3 docs/measurements/h200_1201_s6/scripts/summary.py $OUT/[mno]_*.json
cd $OUT && tar czf all.tgz *.log *.json && ls
