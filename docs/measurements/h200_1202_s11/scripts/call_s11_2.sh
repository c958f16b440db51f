# Session 11, call 2: device time per decode launch and the device's idle gaps between launches (launch_timing), in
# the bench's own process and inside the step (default and engine.sleep_level=0)
source tools/gpu_env.sh >/dev/null 2>&1 || echo "gpu_env failed"
O=$OUT; mkdir -p $O/default $O/level0
export PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 HYBRIDRL_CACHE=/tmp/hybridrl_cache
run() { local n=$1 t=$2; shift 2; echo "== $n"; local t0=$SECONDS; timeout $t "$@" > $O/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; }
G="python3 tools/bench_engine.py --case grpo --shape 1.5b --prompts 32 --samples 8 --new-tokens 512"
run a_bench 70 $G --out $O/a_bench.json
run b_probe_default 230 env OUT=$O/default python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --probe-rollout --model-dir /tmp/m15
run c_probe_level0 230 env OUT=$O/level0 python3 tools/bench_step.py --shape 1.5b --device cuda --tp-iters 1 --probe-rollout --model-dir /tmp/m15 --set engine.sleep_level=0
python3 - <<'PY'
import json, glob, os
O = os.environ["OUT"]
def show(tag, d):
    print(tag, json.dumps(d))
try:
    g = json.load(open(f"{O}/a_bench.json"))["grpo"]
    show("bench tok/s", g["tokens_per_s"]); show("bench launch_timing", g["launch_timing"])
except Exception as e: print("bench", e)
for v in ("default", "level0"):
    for f in glob.glob(f"{O}/{v}/*.json"):
        r = json.load(open(f)); p = r.get("rollout_probe", {})
        show(v + " rollout", r.get("rollout_tokens_per_s"))
        show(v + " probe tok/s", {k: p.get(k, {}).get("tokens_per_s_median") for k in ("step_generate", "worker_again", "engine_direct")})
        show(v + " direct launches", p.get("engine_direct_launches"))
        h = p.get("bench_engine_here", {}); show(v + " here", {"tok/s": h.get("tokens_per_s"), "lt": h.get("launch_timing")})
PY
cd $O && tar czf /tmp/all.tgz . && mv /tmp/all.tgz $O/all.tgz && find . -mindepth 1 -name '*.log' -delete
