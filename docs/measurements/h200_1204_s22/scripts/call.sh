# Session 22 on one H200: the sampler drawn by inverse CDF (one counter uniform per row) against the exponential race
# it replaced. `a`: the sampler's CUDA tests, its kernel sweep beside the old kernel (scratch copy of the old
# `sampling_triton.py`), the 1.5B GRPO bench new / "old" / new in separate processes (the old run imported the new
# package after all: see `ab`); `ab`: the A/B as meant and the step as issue 21 measures it; `d`: the step twice more.
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
OLD=scratch_dev/old_tree  # `git archive <commit before> hybridrl tools conf`: its bench puts its own root first
case ${1:-a} in
ab)  # call 2: the A/B as meant (call 1's old run imported the new package: bench_engine puts its repo root first),
     # then the step, then call.sh n of session 21 (attention on the engine's tables)
run c1_sampler 120 python3 tools/bench_decode_kernels.py --what sampler --shapes 1.5b \
  --sampler-baseline scratch_dev/old/sampling_triton_old.py --out $O/c1_sampler.json
run c2_grpo_old 100 env PYTHONPATH=$OLD:$PYTHONPATH ${G/tools/$OLD\/tools} --out $O/c2_grpo_old.json
run c3_grpo_new 100 $G --out $O/c3_grpo_new.json
run c4_grpo_old 100 env PYTHONPATH=$OLD:$PYTHONPATH ${G/tools/$OLD\/tools} --out $O/c4_grpo_old.json
mkdir -p $O/c5_step
run c5_step 300 env OUT=$O/c5_step python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --model-dir /tmp/m15
;;
a)
run a1_tests 170 env HYBRIDRL_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_sampling_kernel.py tests/test_engine_sampling.py tests/test_fused_engine.py -k "sampl or draw or uniform"
run a2_sampler 120 python3 tools/bench_decode_kernels.py --what sampler --shapes 1.5b \
  --sampler-baseline scratch_dev/old/sampling_triton_old.py --out $O/a2_sampler.json
run a3_grpo_new 100 $G --out $O/a3_grpo_new.json
run a4_grpo_old 100 env PYTHONPATH=$OLD:$PYTHONPATH ${G/tools/$OLD\/tools} --out $O/a4_grpo_old.json
run a5_grpo_new 100 $G --out $O/a5_grpo_new.json
tail -3 $O/a1_tests.log ;;
d)  # call 3: the step twice more with the GRPO bench's profile between, and session 21's attention runs (call.sh n's
    # first); everything packed into one file (a call brings back at most eight)
mkdir -p $O/d1_step $O/d3_step
run d1_step 300 env OUT=$O/d1_step python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --model-dir /tmp/m15
run d2_grpo_profile 150 $G --profile $O/d2_profile_grpo_1.5b.txt --out $O/d2_grpo.json
run d3_step 300 env OUT=$O/d3_step python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --model-dir /tmp/m15
run d4_attn_engine_tables 100 env OUT=$O python3 docs/measurements/h200_1203_s21/scripts/attn_engine_tables.py
(cd $O && tar czf d_all.tgz --exclude=d_all.tgz .) ;;
e)  # call 4: the sampler's CUDA tests again (the kernel as committed), the split attention kernel's launch sweep on
    # the engine's tables (1.5B, 256 rows), then the engine A/B of its best unsplit launch (cand) against the defaults
    # (base), C B C B in separate processes: two scratch copies of this commit, the candidate's with an env override
run e1_tests 170 env HYBRIDRL_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_sampling_kernel.py tests/test_engine_sampling.py tests/test_fused_engine.py -k "sampl or draw or uniform"
run e2_attention 240 python3 tools/bench_decode_kernels.py --what attention --shapes 1.5b --out $O/e2_attention.json
L=$(python3 -c "import json; a=json.load(open('$O/e2_attention.json'))['attention']['1.5b']; \
b=min((r for r in a['all'] if r['n_splits']==1), key=lambda r: r['us']); print(f\"{b['keys']},{b['warps']},{b['stages']}\")")
echo "candidate launch (keys,warps,stages): $L" | tee $O/e_candidate.txt
C=scratch_dev/cand_tree; B=scratch_dev/old_tree
for n in 3 4 5 6; do
  if [ $((n % 2)) = 1 ]; then T=$C; tag=cand; else T=$B; tag=base; fi
  run e${n}_grpo_$tag 100 env HYBRIDRL_ATTN_LAUNCH=$L PYTHONPATH=$T:$PYTHONPATH ${G/tools/$T\/tools} --out $O/e${n}_grpo_$tag.json
done
(cd $O && tar czf e_all.tgz --exclude=e_all.tgz *.log *.json *.txt) ;;
f)  # call 5, with `attention.pipeline_stages` committed: the kernels' CUDA tests, then the step twice with the GRPO
    # bench between; packed into one file
run f1_tests 150 env HYBRIDRL_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_engine_kernels.py tests/test_sampling_kernel.py
mkdir -p $O/f2_step $O/f4_step
run f2_step 200 env OUT=$O/f2_step python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --model-dir /tmp/m15
run f3_grpo 100 $G --out $O/f3_grpo.json
run f4_step 200 env OUT=$O/f4_step python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --model-dir /tmp/m15
tail -3 $O/f1_tests.log
(cd $O && tar czf f_all.tgz --exclude=f_all.tgz f1_tests.log f2_step f2_step.log f3_grpo.json f3_grpo.log f4_step \
  f4_step.log && rm -rf f1_tests.log f2_step f2_step.log f3_grpo.log f4_step f4_step.log) ;;
esac
grep -h "tokens_per_s\"\|tok/s\|rollout_tokens_per_s\|step_s_median" $O/*.log | head -20
