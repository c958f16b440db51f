"""AdamW whose two moments live in host memory and stream through the device for each step.

`trainer.optimizer_on_host=true` (DeepSpeed ZeRO-Offload's `offload_optimizer`, with the update itself kept on the
GPU). Parameters and gradients stay on the device; `exp_avg` and `exp_avg_sq` live in pinned host memory for the
whole run. The step cuts every parameter's local shard into flat chunks (AdamW is elementwise, so a chunk is as good
as a tensor) and, chunk by chunk, copies the moments in on one side stream, runs torch's own AdamW kernel on the
compute stream (the fused or foreach kernel the ordinary optimizer would pick, on the same values: the update is the
ordinary one's), and copies them back on a second side stream. Two chunk slots alternate, so chunk k+1 comes in and
chunk k-1 goes out while chunk k computes: the step costs about two passes of the moments over the host link
(2 × 8 bytes per trained parameter), not the device's memory for them.

Why not FSDP2's CPUOffloadPolicy (parameters, gradients and the step all on the host): at 7.6B parameters its host
state is 4 + 4 + 8 = 16 bytes a parameter, 122 GB, which does not fit beside the process in a 128 GiB host, and a
16-core CPU AdamW over 7.6B parameters takes seconds of CPU per step where the GPU's takes a fraction of the copies.

The moments are views into a few large pinned blocks (`training/pinned_arena.py`: torch's pinned allocator would
round each one up to a power of two, up to twice the host memory), created at the first step and reused by every
resume (a load copies into them instead of casting the whole model's moments to the device first).

On a CPU device "host" and "device" are the same memory; the same chunked path runs there, synchronously, which is
how the tests check it against `torch.optim.AdamW`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from hybridrl.training.offload import local_tensor
from hybridrl.training.pinned_arena import PinnedArena

#: Elements per streamed chunk: 64 Mi float32 elements (256 MiB a moment); two slots of both moments hold 1 GiB of
#: the device during the step. Large enough that each copy runs at the host link's full speed, small next to a 7B
#: model's 30 GB of parameters.
CHUNK_ELEMENTS = 64 * 2**20
MOMENTS = ("exp_avg", "exp_avg_sq")


def _like(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`host` (this rank's part) as a DTensor of `like`'s mesh and placements when `like` is one, so checkpoints see
    a sharded state as for the ordinary optimizer. Built from `like`'s spec, as FSDP2 builds its CPU-offloaded
    parameters: `DTensor.from_local` would move a host tensor to the mesh's device."""
    if isinstance(like, DTensor):
        return DTensor(host, like._spec, requires_grad=False)
    return host


@dataclass
class _Slice:
    """One contiguous run of one parameter's elements inside a chunk."""

    item: int
    """Index of the parameter in the step's work list."""
    start: int
    stop: int
    offset: int
    """Where the run starts in the chunk's device slot."""


def chunk_slices(numels: list[int], chunk: int) -> list[list[_Slice]]:
    """Cut parameters of `numels` elements, end to end, into chunks of at most `chunk` elements."""
    chunks: list[list[_Slice]] = []
    current: list[_Slice] = []
    used = 0
    for item, n in enumerate(numels):
        start = 0
        while start < n:
            take = min(n - start, chunk - used)
            current.append(_Slice(item, start, start + take, used))
            start += take
            used += take
            if used == chunk:
                chunks.append(current)
                current, used = [], 0
    if current:
        chunks.append(current)
    return chunks


class HostAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` with its moments in (pinned) host memory, streamed through the device in chunks of
    `chunk_elements` for each step. Same arguments as AdamW (amsgrad excepted) plus `device`, where the parameters
    are; its state dict is AdamW's, so checkpoints, schedules and resumes treat it as the ordinary optimizer."""

    def __init__(self, params, device: torch.device, chunk_elements: int = CHUNK_ELEMENTS, **adamw_kwargs) -> None:
        if adamw_kwargs.get("amsgrad"):
            raise ValueError("HostAdamW streams two moments; amsgrad's third is not supported")
        super().__init__(params, **adamw_kwargs)
        self.device, self.chunk_elements = device, chunk_elements
        cuda = device.type == "cuda"
        self._arena = PinnedArena(pin=cuda)
        self._in = torch.cuda.Stream(device) if cuda else None  # host → device
        self._out = torch.cuda.Stream(device) if cuda else None  # device → host

    # -- state ------------------------------------------------------------------------------
    def _init_states(self, params: list[torch.Tensor], group: dict) -> None:
        """What AdamW's lazy initialisation makes, with the moments zeros in the host arena."""
        for p in params:
            if group["fused"] or group["capturable"]:  # where torch keeps `step` for these kernels: by the parameter
                self.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=local_tensor(p).device)
            else:
                self.state[p]["step"] = torch.tensor(0.0, dtype=torch.float32)
        self._place(params, {})

    def _place(self, params: list[torch.Tensor], values: dict) -> None:
        """Host moments for `params`: `values[(p, key)]` copied in (zeros where absent), into the host tensor the
        moment already has, else into new arena space."""
        fresh = []
        for p in params:
            for key in MOMENTS:
                held = self.state[p].get(key)
                if held is not None and local_tensor(held).device.type == "cpu":
                    if (p, key) in values:
                        local_tensor(held).copy_(local_tensor(values[p, key]))
                    continue
                fresh.append((p, key))
        shapes = [(local_tensor(p).shape, local_tensor(p).dtype) for p, _ in fresh]
        for (p, key), host in zip(fresh, self._arena.zeros(shapes)):
            if (p, key) in values:
                host.copy_(local_tensor(values[p, key]))
            self.state[p][key] = _like(host, p)

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's load for everything but the moments (which it would cast to the parameters' device, the whole
        model's at once), then the moments copied into their host tensors."""
        saved = state_dict["state"]
        stripped = {i: {k: v for k, v in st.items() if k not in MOMENTS} for i, st in saved.items()}
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        held = {p: {k: st[k] for k in MOMENTS if k in st} for p, st in self.state.items()}
        super().load_state_dict({**state_dict, "state": stripped})
        params = [p for g in self.param_groups for p in g["params"]]
        values = {(p, k): saved[i][k] for i, p in zip(ids, params) if i in saved for k in MOMENTS if k in saved[i]}
        for p, moments in held.items():  # AdamW's load rebuilt each state dict: the host tensors go back in first
            if p in self.state:
                self.state[p].update(moments)
        self._place([p for p in params if any((p, k) in values for k in MOMENTS)], values)

    def host_bytes(self) -> int:
        """Bytes of the moments in host memory (the arena reserves up to its blocks' unused tails more)."""
        return sum(local_tensor(st[k]).nbytes for st in self.state.values() for k in MOMENTS if k in st)

    def _slots_for(self, dtype: torch.dtype, elements: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Device buffers (exp_avg, exp_avg_sq) of the chunk slots: two of a chunk each, or one of `elements` when
        they fit one chunk (nothing to overlap)."""
        make = lambda: torch.empty(min(self.chunk_elements, elements), dtype=dtype, device=self.device)  # noqa: E731
        slot = (make(), make())
        return [slot, (make(), make()) if elements > self.chunk_elements else slot]

    def _side(self, stream: torch.cuda.Stream | None):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    # -- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a gradient, the moments streamed through the device."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._init_states([p for p in group["params"] if p.grad is not None and not self.state.get(p)], group)
            by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor, dict]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                loc = local_tensor(p)
                if not loc.is_contiguous():
                    raise RuntimeError("HostAdamW steps contiguous parameter shards in place; this one is strided")
                by_dtype.setdefault(loc.dtype, []).append((loc.view(-1), local_tensor(p.grad).reshape(-1), state))
            for dtype, work in by_dtype.items():
                self._stream_group(group, dtype, work)
        return loss

    def _stream_group(self, group: dict, dtype: torch.dtype, work: list[tuple[torch.Tensor, torch.Tensor, dict]]):
        """The moments of `work` (flat parameter, flat gradient, state) in, updated and out, chunk by chunk."""
        beta1, beta2 = group["betas"]
        pinned = self._arena.pin  # pinned host memory: the copies run asynchronously on their streams
        host = [[local_tensor(st[k]).view(-1) for k in MOMENTS] for _, _, st in work]
        compute = torch.cuda.current_stream(self.device) if self._in is not None else None
        released: list = [None, None]  # per slot: the event after which its last chunk is back on the host
        numels = [flat.numel() for flat, _, _ in work]
        # Allocated per step and freed after it (the caching allocator keeps the blocks for the next step, or lends
        # them to the engine in between): the device holds no optimizer memory outside the step.
        slots = self._slots_for(dtype, sum(numels))
        for k, chunk in enumerate(chunk_slices(numels, self.chunk_elements)):
            m_slot, v_slot = slots[k % 2]
            with self._side(self._in):
                if released[k % 2] is not None:
                    self._in.wait_event(released[k % 2])  # the slot's previous chunk has left it
                for s in chunk:
                    n = s.stop - s.start
                    m_slot[s.offset : s.offset + n].copy_(host[s.item][0][s.start : s.stop], non_blocking=pinned)
                    v_slot[s.offset : s.offset + n].copy_(host[s.item][1][s.start : s.stop], non_blocking=pinned)
            if compute is not None:
                compute.wait_stream(self._in)
            views = [(s, s.stop - s.start) for s in chunk]
            # Each run advances a copy of its parameter's step; the parameter's own advances once, below.
            adam(
                [work[s.item][0][s.start : s.stop] for s, _ in views],
                [work[s.item][1][s.start : s.stop] for s, _ in views],
                [m_slot[s.offset : s.offset + n] for s, n in views],
                [v_slot[s.offset : s.offset + n] for s, n in views],
                [],
                [work[s.item][2]["step"].clone() for s, _ in views],
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=False,
                fused=group["fused"],
                decoupled_weight_decay=group.get("decoupled_weight_decay", True),
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )
            with self._side(self._out):
                if self._out is not None:
                    self._out.wait_stream(compute)
                for s, n in views:
                    host[s.item][0][s.start : s.stop].copy_(m_slot[s.offset : s.offset + n], non_blocking=pinned)
                    host[s.item][1][s.start : s.stop].copy_(v_slot[s.offset : s.offset + n], non_blocking=pinned)
                if self._out is not None:
                    released[k % 2] = self._out.record_event()
        if self._out is not None:
            # The moments are whole on the host before anything reads them; every copy into and out of the slots
            # has then finished (the out-copies waited for the compute, which waited for the in-copies), so the
            # slots can go back to the allocator.
            self._out.synchronize()
        for _, _, state in work:
            state["step"] += 1
