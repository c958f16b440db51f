# Session 21 on one H200. Call 1 ran ../../h200_1203_s20/scripts/call.sh b (b3, b4), call 2 `mlp_split.py` (this
# folder), call 3 this script's `c`: where the GRPO bench's decode step goes now (the profiler's table over one warm
# 32 × 8 × 512 rollout), the step as issue 21 measures it (bench_step's defaults: 2 warm-up and 3 timed steps,
# offload params,optimizer), then the bench again on the same machine. Calls 4 and 5 ran `attn_heads.py` (the second
# with its sweep widened inline: tiles of 64/128 keys per head, 8/16 warps). Call 6, `e`: the row attention kernel as
# built (`git apply row_attention_not_kept.diff` on the commit that added the diff; reverted after): its CUDA tests,
# the kernel sweep over batch sizes, the GRPO bench with and without it (A B A), the step. Call 7 ran
# `attn_rotated.py`; call 8, with the diff applied again, the GRPO bench `--pdl 0 1` with the row kernel and then with
# `--no-row-attention`. `n` is for the next session (see the README's section).
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
case ${1:-c} in
c)
run c1_grpo_profile 200 $G --profile $O/c1_profile_grpo_1.5b.txt --out $O/c1_grpo.json
mkdir -p $O/c2_step
run c2_step 330 env OUT=$O/c2_step python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --model-dir /tmp/m15
run c3_grpo 150 $G --out $O/c3_grpo.json ;;
e)
run e1_tests 150 env HYBRIDRL_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_engine_kernels.py tests/test_fused_engine.py -k "row_attention or takes_the_row or decode_attention"
run e2_attention_rows 150 python3 tools/bench_decode_kernels.py --what attention_rows --shapes 1.5b 0.5b \
  --out $O/e2_attention_rows.json
run e3_grpo_rows 100 $G --out $O/e3_grpo_rows.json
run e4_grpo_no_rows 100 $G --no-row-attention --out $O/e4_grpo_no_rows.json
run e5_grpo_rows 100 $G --out $O/e5_grpo_rows.json
mkdir -p $O/e6_step
run e6_step 200 env OUT=$O/e6_step python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --model-dir /tmp/m15
;;
n)  # for the next session (not yet run): attention timed on the engine's block tables
run n1_attn_engine_tables 200 python3 docs/measurements/h200_1203_s21/scripts/attn_engine_tables.py
run n2_attention 300 python3 tools/bench_decode_kernels.py --what attention --shapes 1.5b 0.5b --out $O/n2_attention.json
run n3_grpo 100 $G --out $O/n3_grpo.json
;;
esac
tail -3 $O/e1_tests.log 2>/dev/null
grep -h "tokens_per_s\"\|tok/s\|rollout_tokens_per_s\|step_s_median" $O/*.log | head -20
