"""Session 25: auto's graphs without PDL step as fast as PDL's, an engine with PDL off 3% slower, with the same
kernels (layout.py: not where the activations lie). Here `auto` with its choice forced from the first step (only one
kind of graph ever captured, the process-wide switch on as auto leaves it) beside off, on and auto as they are. One
process, one engine (the GRPO bench's 1.5B, 256 rows x 512 new), arms in turn, graphs captured afresh in each.
Usage: python3 forced.py OUT.json"""

import json
import sys

from rig import describe, force_choice, grpo_engine, measure

from hybridrl.engines.kernels import pdl as pdl_switch


def main() -> None:
    engine, prompts = grpo_engine()
    run = engine.runner
    results = []

    def arm(name: str, mode: str, forced: bool | None = None, switch: bool | None = None) -> None:
        run.pdl_mode = mode
        run.drop_graphs()
        if forced is not None:  # the verdict given, no trial: only that kind's graphs are captured
            force_choice(run, forced)
        if switch is not None:  # the process-wide switch (eager launches; graphs captured with kind None)
            pdl_switch.set_enabled(switch)
        measured = measure(engine, prompts)
        row = {"arm": name, **describe(run), **measured}  # the settings and graphs the rollout left
        print(json.dumps(row), flush=True)
        results.append(row)

    arm("off", "off")
    arm("auto", "auto")
    arm("auto_forced_plain", "auto", forced=False)
    arm("auto_forced_pdl", "auto", forced=True)
    arm("on", "on")
    arm("auto_forced_plain_switch_off", "auto", forced=False, switch=False)
    arm("off_again", "off")
    arm("auto_forced_plain_again", "auto", forced=False)
    json.dump(results, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
