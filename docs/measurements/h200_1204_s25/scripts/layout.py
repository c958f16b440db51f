"""Session 25: is the decode graph's speed a matter of where its activations lie? An engine with PDL off steps
2.73-2.74 ms on the device, while auto's graphs without PDL (the same kernels, captured beside the PDL graphs in one
memory pool) step 2.64 ms. Here one process, one engine (the GRPO bench's 1.5B, 256 rows x 512 new), arms in turn,
each with its graphs captured afresh into a new pool: PDL off and on as they are; off captured after a held graph of
PDL's (auto's layout); off after a held pad of P bytes at the pool's start. Per arm: bench_engine's run_generate
(tok/s) and launch_timing (device time per decode launch). Usage: python3 layout.py OUT.json"""

import json
import sys

import torch

from rig import grpo_engine, measure


def pad_pool(nbytes: int):
    """A fresh graph pool whose first `nbytes` are held by a tiny captured graph (returned with it, to keep)."""
    pool = torch.cuda.graph_pool_handle()
    g, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        g.capture_begin(pool=pool)
        x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return pool, (g, x)


def main() -> None:
    engine, prompts = grpo_engine()
    run = engine.runner
    held, results = [], []

    def arm(name: str, mode: str, setup=None) -> None:
        run.pdl_mode = mode
        run.drop_graphs()
        held.clear()
        if setup is not None:
            setup()
        row = {"arm": name, "mode": mode, **measure(engine, prompts)}
        print(json.dumps(row), flush=True)
        results.append(row)

    def twin() -> None:  # PDL's graphs captured first into the pool and held, then off's: auto's layout
        run.pdl_mode = "on"
        measure(engine, prompts)
        held.append((run.pool, dict(run.graphs)))
        pool = run.pool
        run.pdl_mode = "off"  # drops the graphs and the pool
        run.pool = pool

    def pad(nbytes: int):
        def setup() -> None:
            pool, keep = pad_pool(nbytes)
            held.append(keep)
            run.pool = pool
        return setup

    arm("off", "off")
    arm("on", "on")
    arm("off_after_pdl_graphs", "off", twin)
    for p in (512, 65536, 524288, 3 << 20, 12 << 20):
        arm(f"off_pad_{p}", "off", pad(p))
    arm("on_pad_524288", "on", pad(524288))
    arm("off_again", "off")
    arm("on_again", "on")
    json.dump(results, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
