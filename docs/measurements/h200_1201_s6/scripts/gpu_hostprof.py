"""On the GPU: the staggered 512-on-256 multi-turn run (0.5B), timed, then under cProfile (host-side breakdown)."""
import asyncio, cProfile, pstats, sys, time, argparse, io
sys.path.insert(0, "tools"); sys.path.insert(0, ".")
import torch
import bench_engine as B
from hybridrl.engines.async_engine import AsyncEngine
from hybridrl.engines.base import GenerationRequest, SamplingParams
ride = int(sys.argv[1]) if len(sys.argv) > 1 else 512
ap = argparse.Namespace(no_cuda_graphs=False, no_kernels=False, kv_block_size=16, no_skinny_gemm=False,
                        no_rope_attention=False, join_step_tokens=[512], tool_ms=50.0, profile=None)
import os
dev = torch.device(os.environ.get("DEV", "cuda"))
model = B.build_model(os.environ.get("SHAPE", "0.5b"), torch.bfloat16 if dev.type == "cuda" else torch.float32, dev)
T, R, turns, new, plen, tt = 512, 256, 4, 256, 128, 16
ctx = plen + new + turns * tt
eng = B.build_engine(model, ap, R, 1 + T * -(-ctx // 16))
eng.scheduler.join_step_tokens = ride
gen = torch.Generator().manual_seed(3)
vocab = model.config.vocab_size
prompts = torch.randint(2, vocab, (T, plen), generator=gen).tolist()
tools = torch.randint(2, vocab, (T, turns, tt), generator=gen).tolist()
lengths = B.turn_lengths(T, turns, new, True, gen)
async def trajectory(i, agent):
    context = list(prompts[i])
    for k in range(turns):
        out = await agent.generate(GenerationRequest(context, i, k), SamplingParams(temperature=1.0, max_new_tokens=lengths[i][k], seed=0))
        if k < turns - 1:
            await asyncio.sleep(ap.tool_ms / 1e3)
            context = context + out.token_ids + tools[i][k]
async def main():
    agent = AsyncEngine(eng)
    await asyncio.gather(*(trajectory(i, agent) for i in range(T)))
for rep in range(3):
    eng.cache is not None and eng.cache.allocator.forget_prefixes()
    (torch.cuda.synchronize() if dev.type == "cuda" else None); t0 = time.perf_counter(); s0 = eng.scheduler.steps
    asyncio.run(main()); (torch.cuda.synchronize() if dev.type == "cuda" else None)
    print(f"ride={ride} run {rep}: {time.perf_counter() - t0:.3f}s steps {eng.scheduler.steps - s0}")
eng.cache is not None and eng.cache.allocator.forget_prefixes()
pr = cProfile.Profile()
(torch.cuda.synchronize() if dev.type == "cuda" else None); t0 = time.perf_counter(); s0 = eng.scheduler.steps
pr.enable(); asyncio.run(main()); (torch.cuda.synchronize() if dev.type == "cuda" else None); pr.disable()
print(f"profiled: {time.perf_counter() - t0:.3f}s steps {eng.scheduler.steps - s0}")
st = pstats.Stats(pr)
st.sort_stats("tottime").print_stats(45)
st.sort_stats("cumtime").print_stats("hybridrl", 45)
