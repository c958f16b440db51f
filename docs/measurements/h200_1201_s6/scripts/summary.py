"""One line per multi-turn variant of the bench JSONs named on the command line (what each call printed at its end;
factored out of the call scripts after the runs)."""
import json
import os
import sys

for p in sys.argv[1:]:
    d = json.load(open(p))["multiturn"]
    print(os.path.basename(p), "single", round(d["single_turn"]["tokens_per_s"]),
          "bound", round(d["lockstep_bound_vs_single_turn"], 3))
    for k, v in d["variants"].items():
        waits = [round(x, 3) for x in v.get("host_wait_s_runs", [])]
        print(f"  {k:28s} {v['tokens_per_s']:9.0f} {v['vs_single_turn']:.3f} pf={v['prefill_calls']} "
              f"sj={v['step_joins']} steps={v['engine_steps']} rows={v['mean_rows_per_step']:.1f} "
              f"ms/step={v['ms_per_engine_step']:.2f} cold={v['seconds_cold']:.2f} "
              f"warm={[round(x, 3) for x in v['seconds_warm_runs']]} wait={waits}")
