# Experiment of call c_ (under ncu) (docs/measurements/README.md, fifth 2026-12-01 session), kept as run. From the repo root
# on the device: PYTHONPATH=. python3 docs/measurements/h200_1201_s5/scripts/c_ncu_sampler.py
import sys, torch
sys.path.insert(0, ".")
from hybridrl.engines import sampling_triton as st
rows = 256
logits = torch.randn(rows, 151936, device="cuda").to(torch.bfloat16)
keys = torch.randint(0, 2**62, (rows,), device="cuda")
for _ in range(3):
    st.sample_counter(logits, 1.0, keys, 12345)
torch.cuda.synchronize()
