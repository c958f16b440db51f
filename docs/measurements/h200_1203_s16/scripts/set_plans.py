"""Write the sweep's winning tiles (`bench_decode_kernels.py --what mlp`'s `mlp_plans`) into kernels/mlp.py's PLANS
on the device's copy of the tree, so the engine benches that follow run them. Rows whose best tile lost on a shape
get None (unfused)."""
import json
import re
import sys

report = json.load(open(sys.argv[1]))
plans = report["mlp_plans"]
entries = []
for rows in sorted(plans, key=int):
    p = plans[rows]
    cfg = "GateUpPlan({block_m}, {block_n}, {block_k}, {warps}, {stages})".format(**p["plan"])
    entries.append(f"    ({int(rows)}, {cfg if p['wins_everywhere'] else 'None'}),")
path = "hybridrl/engines/kernels/mlp.py"
src = open(path).read()
new = re.sub(r"(PLANS: list\[tuple\[int, GateUpPlan \| None\]\] = \[\n)(.*?)(\n\])",
             lambda m: m.group(1) + "\n".join(entries) + m.group(3), src, count=1, flags=re.S)
assert new != src or not entries, "PLANS not found"
open(path, "w").write(new)
print("PLANS:\n" + "\n".join(entries))
