# Session 13 on one H200: which part of a training step's process makes the same decode graphs slower there
# (in-step rollout 87.5-88.1k tok/s against 89.6-89.9k for bench_engine alone, same machine)?
# Call 1 (`a`, the s11 plan): the bench with the trainer's compiled layers in its own process lost nothing; its NCCL arms
# failed on a device without an index (fixed in workers/dist.py). Call 2 (`b`): the NCCL arms, then the step without
# compile and without PDL. Call 3 (`c`): NCCL again between plain runs, all the step's pieces together, the step
# without offload.
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
S="python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --probe-rollout --model-dir /tmp/m15"
step() { local n=$1; shift; mkdir -p $O/$n; run $n ${STEP_S:-170} env OUT=$O/$n $S "$@"; }
case ${1:-b} in
b)
  run b1_bench_plain 60 $G --out $O/b1.json
  run b2_bench_nccl 60 $G --process-state nccl --out $O/b2.json
  run b3_bench_plain 60 $G --out $O/b3.json
  run b4_bench_nccl_compile 90 $G --process-state nccl compile --out $O/b4.json
  step b5_step_no_compile --set trainer.compile=false
  step b6_step_no_pdl --set engine.native.pdl=false ;;
c)  # the step's pieces together in the bench's process, interleaved with plain runs; the step without offload
  run c1_bench_plain 60 $G --out $O/c1.json
  run c2_bench_nccl 60 $G --process-state nccl --out $O/c2.json
  run c3_bench_plain 60 $G --out $O/c3.json
  run c4_bench_all 120 $G --process-state nccl compile --live-gb 60 --out $O/c4.json
  run c5_bench_plain 60 $G --out $O/c5.json
  step c6_step_no_offload --offload none ;;
d)  # call 4: bench_engine's run in the step's process before its first step and after its steps; the bench alone
  run d1_bench_plain 60 $G --out $O/d1.json
  STEP_S=220 step d2_step_probe_first --probe-first
  run d3_bench_plain 60 $G --out $O/d3.json ;;
e)  # call 5: the same probes with the engine's memory mapped once and never released (sleep level 0)
  STEP_S=200 step e1_step_probe_first_level0 --probe-first --set engine.sleep_level=0 ;;
esac
cd $O && tar czf /tmp/all.tgz . && mv /tmp/all.tgz $O/all.tgz && find . -mindepth 1 \( -name '*.log' -o -name '[bcd]?.json' \) -delete
