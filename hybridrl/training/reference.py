"""The reference role: a frozen copy of the initial policy that scores the rollout for the KL term.

It moves on its own schedule, so its copies hide behind the actor's work::

    ref.onload(wait=False)          # phase "logprob": starts behind the actor's log-prob passes
    ref_logp = ref.compute_logprobs(micro)
    ref.offload(wait=False)         # its copy to host starts behind the pass (freed before the update if it needs
                                    # the room: workers/device_room.py)
    ref.offload()                   # phase "wake": completes that copy and frees the device memory
"""

from __future__ import annotations

import torch

from hybridrl.models.config import ModelConfig
from hybridrl.models.loading import load_causal_lm
from hybridrl.training.config import TrainerConfig
from hybridrl.training.fsdp import Precision, compile_layers, reshard_units, shard_model, use_compile
from hybridrl.training.micro_batches import MicroBatch, scatter_rows
from hybridrl.training.offload import HostOffloader, timed_moves
from hybridrl.training.pass_meter import PassMeter
from hybridrl.training.trainer import model_logprobs
from hybridrl.training.ulysses import use_training_attention
from hybridrl.training.vision import prepare_policy


class Reference:
    """The frozen reference policy, sharded like the actor and stored in the compute dtype (no float32 master:
    FSDP would cast it to that dtype anyway, so this halves its memory and the bytes each offload moves)."""

    name = "ref"

    def __init__(
        self,
        model_path: str,
        model_cfg: ModelConfig,
        cfg: TrainerConfig,
        device: torch.device,
        mesh,
        pad_token_id: int,
        temperature: float,
        offload: bool,
        sequence_parallel_size: int = 1,
    ) -> None:
        self.cfg, self.device = cfg, device
        self.pad_token_id, self.temperature = pad_token_id, temperature
        precision = Precision.for_device(cfg.param_dtype, device)
        model = load_causal_lm(model_path, model_cfg, precision.frozen_dtype, device).eval().requires_grad_(False)
        # It scores the actor's micro-batches (sequence-parallel slices too): its attention must match.
        use_training_attention(model, cfg, model_cfg.attn_implementation, sequence_parallel_size)
        prepare_policy(model, model_cfg, trains=False)
        if use_compile(cfg.compile, model_cfg.gradient_checkpointing, device):
            compile_layers(model)
        self.model = shard_model(model, mesh, precision.policy, cfg.fsdp_layers_per_unit, cfg.reshard_after_forward)
        self.offloader = HostOffloader(
            lambda: list(self.model.parameters()), device, enabled=offload and device.type == "cuda"
        )
        self.meter = PassMeter()  # the actor's, on a worker (`workers/build.py`)

    def onload(self, wait: bool = True) -> dict[str, float]:
        """Parameters back on the device; with wait=False on a side stream (joined by `compute_logprobs`)."""
        moved = self.offloader.onload(wait=wait)
        return {"offload/ref/onload_gb": moved / 1e9} if moved else {}

    def lazy_offloaders(self) -> list[HostOffloader]:
        """The offloader, its copy possibly in flight since the log-prob phase, for a lazy offload
        (workers/device_room.py) to complete only if the engine needs its room."""
        reshard_units(self.model)
        return [self.offloader]

    def offload(self, wait: bool = True) -> dict[str, float]:
        """Parameters to host memory. wait=False starts the copy and returns; wait=True completes a copy in flight
        (or makes one) and frees the device memory."""
        reshard_units(self.model)
        if not wait:
            self.offloader.offload(wait=False)
            return {}
        return timed_moves("offload/ref/offload", self.device, self.offloader.complete)

    @torch.no_grad()
    def compute_logprobs(self, micro: list[MicroBatch]) -> dict[str, torch.Tensor]:
        """Reference log-probs of the response tokens in the batch's row order (joins an onload still in flight
        first); `micro` are the actor's micro-batches, packed once for both."""
        self.offloader.onload()  # a no-op after onload(wait=False), except to cancel an unfinished offload
        self.offloader.wait()
        with self.meter.timed(micro):
            out = [model_logprobs(self.model, m, self.cfg, self.temperature)[0].cpu() for m in micro]
        return {"ref_logprobs": scatter_rows(out, micro, sum(len(m.rows) for m in micro))}

    def memory_stats(self) -> dict[str, float]:
        """GiB of the reference's parameters on the device and in host memory."""
        return self.offloader.stats("params")
