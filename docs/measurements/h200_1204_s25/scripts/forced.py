"""Session 25: auto's graphs without PDL step as fast as PDL's, an engine with PDL off 3% slower, with the same
kernels (layout.py: not where the activations lie). Here `auto` with its choice forced from the first step (only one
kind of graph ever captured, the process-wide switch on as auto leaves it) beside off, on and auto as they are. One
process, one engine (the GRPO bench's 1.5B, 256 rows x 512 new), arms in turn, graphs captured afresh in each.
Usage: python3 forced.py OUT.json"""

import dataclasses
import json
import sys
import types

import torch

sys.path.insert(0, "tools")
import bench_engine as be  # noqa: E402
from hybridrl.engines.fused.launch_choice import PdlVerdict  # noqa: E402
from hybridrl.engines.kernels import pdl as pdl_switch  # noqa: E402


def main() -> None:
    device = torch.device("cuda")
    args = types.SimpleNamespace(no_cuda_graphs=False, no_kernels=False, kv_block_size=16, join_step_tokens=[512],
                                 pdl=["off"], no_skinny_gemm=False, no_rope_attention=False)
    model = be.build_model("1.5b", torch.bfloat16, device)
    engine = be.build_engine(model, args, 256)
    run = engine.runner
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(2, model.config.vocab_size, (32, 128), generator=gen).tolist()
    results = []

    def arm(name: str, mode: str, forced: bool | None = None, switch: bool | None = None) -> None:
        run.pdl_mode = mode
        run.drop_graphs()
        if forced is not None:  # the verdict given, no trial: only that kind's graphs are captured
            choice = run.pdl_choice
            choice.verdict, choice._deciding = PdlVerdict(forced, 0.0, 0.0), False
            choice.restart = lambda: None
        if switch is not None:  # the process-wide switch (eager launches; graphs captured with kind None)
            pdl_switch.set_enabled(switch)
        res, _, params = be.run_generate(engine, prompts, 8, 512, device)
        lt = be.timed_launches(engine, prompts, params, device)
        choice = run.pdl_choice
        row = {"arm": name, "mode": run.pdl_mode, "switch": pdl_switch.is_enabled(),
               "verdict": None if choice is None or choice.verdict is None else dataclasses.asdict(choice.verdict),
               "graph_kinds": sorted({str(k[-1]) for k in run.graphs}), "graphs": len(run.graphs),
               "tokens_per_s": res["tokens_per_s"], "decode_step_ms": res["decode_step_ms"],
               "busy_ms_median": lt["busy_ms_median"]}
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
