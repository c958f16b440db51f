"""Run a worker script in N processes that join one gloo group, and collect each rank's JSON results.

Ranks fork from a forkserver that has `preload` imported already: spawning fresh interpreters costs
~10 s of CPU per rank on 2 cores. The script gets `ARGS` (the given args plus `rank`) as a global,
joins the group through the FileStore at `ARGS["store_path"]`, and writes `rank<r>.json` into
`ARGS["out_dir"]` (a `__fatal__` key for an error outside any case). A rank still running at the
deadline is killed, and the test fails naming it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import runpy
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCH_PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
]


def run_world(
    script: Path, world: int, tmp: Path, args: dict, timeout: float, preload: list[str] = TORCH_PRELOAD
) -> dict[int, dict]:
    """Start `world` ranks of `script`, wait up to `timeout` s in total, return {rank: results}.

    The script runs with `__name__ == "__dist_worker__"` (its guard for the entry point)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    common = dict(
        args, world=world, store_path=str(tmp / "store"), out_dir=str(tmp), paths=[str(script.parent), str(REPO)]
    )
    procs = [
        ctx.Process(
            target=runpy.run_path,
            kwargs=dict(
                path_name=str(script), init_globals={"ARGS": {**common, "rank": rank}}, run_name="__dist_worker__"
            ),
        )
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join(5)
    results = {}
    for rank in range(world):
        path = tmp / f"rank{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.exists() else {}
    fatal = {r: res["__fatal__"] for r, res in results.items() if "__fatal__" in res}
    if hung or fatal:
        pytest.fail(
            f"{script.name}, world {world}: ranks {hung} hung past {timeout:.0f}s; fatal errors: {fatal}; "
            f"results: {results}"
        )
    return results


def results_by_case(results: dict[int, dict], cases: list[dict]) -> dict[str, list[str]]:
    """{case id: [result per rank]} ("missing" where a rank reported nothing for the case)."""
    return {c["id"]: [results[r].get(c["id"], "missing") for r in sorted(results)] for c in cases}


def worker_main(
    rank: int, world: int, store_path: str, out_dir: str, cases: list[dict], paths: list[str], setup, check
) -> None:
    """The body every `*_dist_worker.py` runs on its rank: join the gloo group, `context = setup(rank, world)`
    (meshes, TP groups: made on every rank in the same order), `check(case, rank, world, context)` per case (a
    string: "ok" or what went wrong; an exception is written as one), then `rank<r>.json` and a hard exit (a plain
    exit can abort in DeviceMesh teardown, PLATFORM_FACTS)."""
    import os
    import sys
    import traceback

    sys.path[:0] = paths
    results: dict[str, str] = {}
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # 2-4 ranks share 2 cores
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        context = setup(rank, world)
        for case in cases:
            try:
                results[case["id"]] = check(case, rank, world, context)
            except Exception:
                results[case["id"]] = f"rank {rank}: " + traceback.format_exc()
            dist.barrier()  # a failed rank must not leave the others inside a collective of the next case
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({**results, "__fatal__": traceback.format_exc()}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
