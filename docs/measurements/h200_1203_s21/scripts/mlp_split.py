"""Scratch of session 21, kept as run (call 2): the 1.5B MLP at 256 rows with gate_up cut into whole cuBLAS rounds + a tail.

From the repo root on the device: PYTHONPATH=. python3 docs/measurements/h200_1203_s21/scripts/mlp_split.py"""
import json, sys, os
sys.path.insert(0, "tools")
import torch, torch.nn.functional as F
import triton, triton.language as tl
from bench_decode_kernels import graph_time_us
from hybridrl.engines.kernels.norms import silu_mul_triton, add_rms_norm_triton
from hybridrl.engines.kernels.linear import linear_batched

@triton.jit
def _silu2(g_ptr, out_ptr, inter, half, g_row, o_row, o_off, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(g_ptr + row * g_row + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(g_ptr + half + row * g_row + cols, mask=m, other=0.0).to(tl.float32)
    y = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32) * u
    tl.store(out_ptr + row * o_row + o_off + cols, y.to(out_ptr.dtype.element_ty), mask=m)

def silu2(g, out, off):
    _, n, inter = g.shape
    block = min(1024, triton.next_power_of_2(inter))
    _silu2[(n, triton.cdiv(inter, block))](g, out, inter, g.stride(0), g.stride(1), out.stride(0), off, BLOCK=block)

dev = torch.device("cuda")
M, H, I = 256, 1536, 8960
res = {"gpu": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count}
h = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
W = torch.randn(2 * I, H, device=dev, dtype=torch.bfloat16) / H**0.5
Wd = torch.randn(H, I, device=dev, dtype=torch.bfloat16) / I**0.5
nw = torch.ones(H, device=dev, dtype=torch.bfloat16)
Wv = W.view(2, I, H)
t = {}
for n in (17920, 16896, 16384, 8448, 8960, 1024, 2048, 4096):
    w = torch.randn(n, H, device=dev, dtype=torch.bfloat16)
    t[f"linear_n{n}"] = graph_time_us(lambda w=w: F.linear(h, w))
hb = h.expand(2, M, H)
for cut in (8448, 8192, 7680):
    head_w = Wv[:, :cut].transpose(1, 2)
    tail_w = Wv[:, cut:].transpose(1, 2)
    t[f"bmm_head{cut}"] = graph_time_us(lambda: torch.bmm(hb, head_w))
    t[f"bmm_tail{cut}"] = graph_time_us(lambda: torch.bmm(hb, tail_w))
    t[f"bmm_head_tail{cut}"] = graph_time_us(lambda: (torch.bmm(hb, head_w), torch.bmm(hb, tail_w)))
    side = torch.cuda.Stream()
    def two_streams():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        a = torch.bmm(hb, head_w)
        with torch.cuda.stream(side):
            b = torch.bmm(hb, tail_w)
        main.wait_stream(side)
        return a, b
    t[f"bmm_two_streams{cut}"] = graph_time_us(two_streams)

def mlp_now():
    act = silu_mul_triton(F.linear(h, W))
    return add_rms_norm_triton(x, linear_batched(act, Wd, 4), nw, 1e-6)

def mlp_split(cut=8448, streams=False):
    head_w, tail_w = Wv[:, :cut].transpose(1, 2), Wv[:, cut:].transpose(1, 2)
    side = torch.cuda.Stream()
    def run():
        act = torch.empty(M, I, device=dev, dtype=torch.bfloat16)
        if streams:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                gt = torch.bmm(hb, tail_w)
                silu2(gt, act, cut)
            gh = torch.bmm(hb, head_w)
            silu2(gh, act, 0)
            main.wait_stream(side)
        else:
            gh = torch.bmm(hb, head_w)
            gt = torch.bmm(hb, tail_w)
            silu2(gh, act, 0)
            silu2(gt, act, cut)
        return add_rms_norm_triton(x, linear_batched(act, Wd, 4), nw, 1e-6), act
    return run

ref = silu_mul_triton(F.linear(h, W))
for cut in (8448, 8192):
    for streams in (False, True):
        run = mlp_split(cut, streams)
        got = run()[1]
        torch.cuda.synchronize()
        t[f"check_cut{cut}_streams{int(streams)}_maxdiff"] = (got.float() - ref.float()).abs().max().item()
for rep in range(2):
    t[f"mlp_now_{rep}"] = graph_time_us(mlp_now)
    for cut in (8448, 8192):
        t[f"mlp_split{cut}_{rep}"] = graph_time_us(mlp_split(cut))
        t[f"mlp_split{cut}_streams_{rep}"] = graph_time_us(mlp_split(cut, True))
    t[f"silu_now_{rep}"] = graph_time_us(lambda: silu_mul_triton(ref.new_empty(M, 2 * I)))
res["us"] = t
print(json.dumps(res, indent=1))
open(os.path.join(os.environ.get("OUT", "."), "mlp_split.json"), "w").write(json.dumps(res, indent=1))
