"""Session 25: is the decode graph's speed a matter of where its activations lie? An engine with PDL off steps
2.73-2.74 ms on the device, while auto's graphs without PDL (the same kernels, captured beside the PDL graphs in one
memory pool) step 2.64 ms. Here one process, one engine (the GRPO bench's 1.5B, 256 rows x 512 new), arms in turn,
each with its graphs captured afresh into a new pool: PDL off and on as they are; off captured after a held graph of
PDL's (auto's layout); off after a held pad of P bytes at the pool's start. Per arm: bench_engine's run_generate
(tok/s) and launch_timing (device time per decode launch). Usage: python3 layout.py OUT.json"""

import json
import sys
import types

import torch

sys.path.insert(0, "tools")
import bench_engine as be  # noqa: E402


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
    device = torch.device("cuda")
    args = types.SimpleNamespace(no_cuda_graphs=False, no_kernels=False, kv_block_size=16, join_step_tokens=[512],
                                 pdl=["off"], no_skinny_gemm=False, no_rope_attention=False)
    model = be.build_model("1.5b", torch.bfloat16, device)
    engine = be.build_engine(model, args, 256)
    run = engine.runner
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(2, model.config.vocab_size, (32, 128), generator=gen).tolist()
    held, results = [], []

    def arm(name: str, mode: str, setup=None) -> None:
        run.pdl_mode = mode
        run.drop_graphs()
        held.clear()
        if setup is not None:
            setup()
        res, _, params = be.run_generate(engine, prompts, 8, 512, device)
        lt = be.timed_launches(engine, prompts, params, device)
        row = {"arm": name, "mode": mode, "tokens_per_s": res["tokens_per_s"],
               "decode_step_ms": res["decode_step_ms"], "busy_ms_median": lt["busy_ms_median"],
               "gap_ms_total": lt["gap_ms_total"]}
        print(json.dumps(row), flush=True)
        results.append(row)

    def twin() -> None:  # PDL's graphs captured first into the pool and held, then off's: auto's layout
        run.pdl_mode = "on"
        be.run_generate(engine, prompts, 8, 512, device)
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
