"""Session 25: a plain decode graph steps 2.64 ms with the process-wide PDL switch on and 2.72 ms with it off
(forced.py). What under the switch does it? The switch sets the kind of every launch outside the decode graphs: the
prompts' prefill (its graph) and eager launches, inside a decode launch (`runner.launch`: its graph's replay, any
eager sampler, the outputs' copy) or outside. Arms: the decode graphs forced plain, the switch on or off, and
- call l (`inside=`): the switch set apart inside `runner.launch` (its loop then ran plain_switch_on, plain_switch_off,
  then `inside=False` with the switch on and `inside=True` with it off, twice);
- call m (the loop as it is): the switch set apart for the prefill (`runner.extend`), and the switch off with a tiny
  graph of PDL launches held.
One process, one engine (the GRPO bench's 1.5B, 256 rows x 512 new), graphs captured afresh in each arm.
Usage: python3 pin.py OUT.json"""

import json
import sys

import torch
from rig import DEVICE, describe, force_choice, grpo_engine, measure

from hybridrl.engines.kernels import norms
from hybridrl.engines.kernels import pdl as pdl_switch


def main() -> None:
    engine, prompts = grpo_engine()
    run = engine.runner
    results, held = [], []

    def dummy_pdl_graph():
        """A tiny graph of two PDL launches (two RMSNorms), captured in its own pool, replayed once."""
        x = torch.randn(256, 1536, device=DEVICE, dtype=torch.bfloat16)
        w = torch.ones(1536, device=DEVICE, dtype=torch.bfloat16)
        g, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with pdl_switch.switched(True):
            norms.add_rms_norm_triton(x, None, w, 1e-6)  # compiled before the capture
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                g.capture_begin()
                _, y = norms.add_rms_norm_triton(x, None, w, 1e-6)
                norms.add_rms_norm_triton(y, None, w, 1e-6)
                g.capture_end()
            torch.cuda.current_stream().wait_stream(side)
        g.replay()
        return g, x, w

    def arm(name: str, mode: str, forced: bool | None = None, switch: bool | None = None,
            inside: bool | None = None, prefill: bool | None = None, dummy: bool = False) -> None:
        run.pdl_mode = mode
        run.drop_graphs()
        held.clear()
        if dummy:
            held.append(dummy_pdl_graph())
        run.__dict__.pop("launch", None)
        run.__dict__.pop("extend", None)
        if prefill is not None:  # the prefill's launches (and its graph's capture) of this kind, whatever the switch
            extend = run.extend

            def kind_extend(*a, **k):
                with pdl_switch.switched(prefill):
                    return extend(*a, **k)
            run.extend = kind_extend
        if inside is not None:  # the decode launches' own eager launches of this kind, whatever the switch
            launch = run.launch

            def kind_launch(*a, **k):
                with pdl_switch.switched(inside):
                    return launch(*a, **k)
            run.launch = kind_launch
        if forced is not None:  # the verdict given, no trial
            force_choice(run, forced)
        if mode == "auto":  # the process-wide switch (eager launches; graphs captured with kind None)
            pdl_switch.set_enabled(True if switch is None else switch)
        measured = measure(engine, prompts)
        row = {"arm": name, **describe(run), **measured}  # the settings and graphs the rollout left
        print(json.dumps(row), flush=True)
        results.append(row)

    for rep in ("", "_again"):
        arm("plain_switch_on" + rep, "auto", forced=False)
        arm("plain_switch_off" + rep, "auto", forced=False, switch=False)
        arm("plain_switch_on_prefill_plain" + rep, "auto", forced=False, switch=True, prefill=False)
        arm("plain_switch_off_prefill_pdl" + rep, "auto", forced=False, switch=False, prefill=True)
        arm("plain_switch_off_pdl_graph_held" + rep, "auto", forced=False, switch=False, dummy=True)
    json.dump(results, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
