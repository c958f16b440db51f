"""What every trained FSDP role shares: the sharded model, AdamW, the lr schedule, host offload and checkpoints.

The actor (`training/trainer.py`) and a critic build on it; each adds its own forward and loss. A role's
memory lifecycle inside one iteration::

    learner.offload()            # before the rollout: parameter shards and/or Adam state to pinned host memory
                                 # (lazy: lazy_offloaders() run only if the engine needs their room)
    learner.onload_params()      # before the forward passes
    learner.onload_optimizer()   # before the update (started early with wait=False, joined here)
    learner.optimizer_step()     # after the micro-batches' backward passes; refuses a step past the divergence guard

With `optimizer_on_host` the Adam moments never occupy the device: they live in pinned host memory and stream
through it during the step (`training/host_optimizer.py`), so there is no optimizer state to offload or onload.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybridrl.errors import DivergenceError, HybridRLError
from hybridrl.training.checkpoint import load_trainer, save_trainer
from hybridrl.training.fsdp import reshard_units
from hybridrl.training.host_optimizer import HostAdamW
from hybridrl.training.offload import HostOffloader, timed_moves
from hybridrl.training.schedule import build_scheduler

log = logging.getLogger(__name__)


def divergence(before: float, after: float, bound: float) -> str | None:
    """Why a step that took the parameters' norm from `before` to `after` is past `bound`, or None when it is not.

    An update that scales the weights' norm by more than `bound` (or shrinks it below 1/`bound`) in one step is not
    learning: AdamW moves each weight by about lr per step, far below the weights' own scale at any usable lr (at
    lr=1e-3 and weights of rms 0.02, the norm changes by a few percent). A zero norm before (untrained adapters)
    is only checked for staying finite."""
    if not math.isfinite(after):
        return f"left the trained parameters' norm non-finite ({after}; it was {before:.4g})"
    if before > 0 and not 1 / bound <= after / before <= bound:
        return f"changed the trained parameters' norm from {before:.4g} to {after:.4g} (x{after / before:.3g})"
    return None


class FSDPLearner:
    """An FSDP2 model with AdamW, a warmup/cosine schedule and per-part host offload.

    `optim` is any config with the optimizer fields of `TrainerConfig` (lr, betas, eps, weight_decay,
    warmup_steps, lr_schedule, min_lr_ratio, grad_clip, fused_optimizer, optimizer_on_host); `offload_parts` says
    what goes to host memory during the rollout ("params", "optimizer"), which only a GPU honours.
    """

    #: The role's name in metrics and checkpoints ("actor", "critic").
    name = "learner"

    def __init__(
        self, model: torch.nn.Module, optim, offload_parts: set[str], device: torch.device, total_optimizer_steps: int
    ) -> None:
        self.model, self.optim, self.device = model, optim, device
        # Frozen parameters (a LoRA base) get neither gradients nor optimizer state.
        trainable = [p for p in model.parameters() if p.requires_grad]
        adamw = dict(
            lr=optim.lr,
            betas=tuple(optim.betas),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=True if optim.fused_optimizer and device.type == "cuda" else None,
        )
        self.optimizer_on_host = bool(optim.optimizer_on_host)
        if self.optimizer_on_host:
            self.optimizer: torch.optim.AdamW = HostAdamW(trainable, device=device, **adamw)
        else:
            self.optimizer = torch.optim.AdamW(trainable, **adamw)
        self.scheduler = build_scheduler(
            self.optimizer, optim.warmup_steps, total_optimizer_steps, optim.lr_schedule, optim.min_lr_ratio
        )
        on_gpu = device.type == "cuda"
        self.param_offload = HostOffloader(
            lambda: list(self.model.parameters()), device, enabled="params" in offload_parts and on_gpu
        )
        self.nonfinite_total = 0  # optimizer steps skipped for a non-finite gradient norm, over the run
        self.nonfinite_in_a_row = 0
        # Moments kept on the host leave nothing of the optimizer on the device to offload.
        self.optim_offload = HostOffloader(
            lambda: [
                v
                for st in self.optimizer.state.values()
                for v in st.values()
                if torch.is_tensor(v) and not self.optimizer_on_host
            ],
            device,
            enabled="optimizer" in offload_parts and on_gpu and not self.optimizer_on_host,
        )

    # -- memory ---------------------------------------------------------------------------
    def offload(self) -> dict[str, float]:
        """Parameters and/or optimizer state to pinned host memory, per the offload policy (for the rollout)."""
        reshard_units(self.model)  # offload moves shards, not the full copy a forward leaves at world size 1
        return timed_moves(
            f"offload/{self.name}/offload", self.device, self.param_offload.offload, self.optim_offload.offload
        )

    def lazy_offloaders(self) -> list[HostOffloader]:
        """The offloaders `offload` would run, for a lazy offload (workers/device_room.py) to run only if the engine
        needs their room; the full copy a forward leaves at world size 1 is freed now, as `offload` does first."""
        reshard_units(self.model)
        return [self.param_offload, self.optim_offload]

    def onload_params(self) -> dict[str, float]:
        """Parameters back on the device, before the forward passes."""
        return timed_moves(f"offload/{self.name}/onload_params", self.device, self.param_offload.onload)

    def onload_optimizer(self, wait: bool = True) -> dict[str, float]:
        """Optimizer state back on the device. With wait=False the copy runs on a side stream behind the caller's
        work; a later call with wait=True joins it before the update."""
        if not self.optim_offload.enabled:
            return {}
        if not wait:
            moved = self.optim_offload.onload(wait=False)
            return {f"offload/{self.name}/onload_optim_gb": moved / 1e9} if moved else {}
        t0 = time.perf_counter()
        moved = self.optim_offload.onload()  # nothing left unless the early onload was skipped
        self.optim_offload.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        out = {f"offload/{self.name}/onload_optim_wait_s": time.perf_counter() - t0}
        if moved:
            out[f"offload/{self.name}/onload_optim_gb"] = moved / 1e9
        return out

    def memory_stats(self) -> dict[str, float]:
        """GiB of this role's parameters and optimizer state on the device and in host memory."""
        if self.optimizer_on_host:
            optim = {"optimizer_device_gb": 0.0, "optimizer_host_gb": self.optimizer.host_bytes() / 2**30}
        else:
            optim = self.optim_offload.stats("optimizer")
        return {**self.param_offload.stats("params"), **optim}

    # -- optimization ---------------------------------------------------------------------
    def _global_sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over every rank (a loss normalizer over the whole mini-batch), in float32 on the device."""
        value = value.to(self.device, torch.float32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(value)
        return value

    def optimizer_step(self) -> float:
        """Clip the gradient norm, step AdamW and the schedule; returns the norm before clipping.

        A non-finite norm (a NaN/inf loss or gradient anywhere: the norm is global over all ranks) skips the step on
        every rank and is counted; `max_nonfinite_steps` of them in a row stop the run (`FSDPLearner.nonfinite_*`).
        A step that takes the trained parameters' norm past `max_param_norm_ratio` (`check_param_norm`) stops the run
        with a DivergenceError before its weights reach the engine or a checkpoint."""
        max_norm = self.optim.grad_clip if self.optim.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if torch.isfinite(norm):
            bound = getattr(self.optim, "max_param_norm_ratio", 0.0)
            before = self.param_norm() if bound else 0.0
            self.optimizer.step()
            if bound:
                self.check_param_norm(before, self.param_norm(), bound)
            self.nonfinite_in_a_row = 0
        else:
            self.nonfinite_total += 1
            self.nonfinite_in_a_row += 1
            log.warning(
                "%s: non-finite gradient norm %s: optimizer step skipped (%d in a row)",
                self.name,
                norm.item(),
                self.nonfinite_in_a_row,
            )
            limit = self.optim.max_nonfinite_steps
            if limit and self.nonfinite_in_a_row >= limit:
                raise HybridRLError(
                    f"{self.name}: {self.nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or "
                    f"gradient norm (trainer.max_nonfinite_steps={limit}); the run stops with its weights untouched "
                    "since the last finite step. Lower trainer.lr, check the rewards and advantages, "
                    "or resume from a checkpoint"
                )
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm.item()

    @torch.no_grad()
    def param_norm(self) -> float:
        """Global L2 norm of the trained parameters over every rank (collective): one pass over the local shards."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.model.parameters():
            if p.requires_grad:
                local = p.to_local() if hasattr(p, "to_local") else p
                if local.numel():
                    total += local.detach().double().pow(2).sum()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        return math.sqrt(total.item())

    def check_param_norm(self, before: float, after: float, bound: float) -> None:
        """DivergenceError when one optimizer step changed the trained parameters' norm by more than a factor
        `bound` (either way), or left it non-finite (`divergence` has the rule)."""
        why = divergence(before, after, bound)
        if why is None:
            return
        raise DivergenceError(
            f"{self.name}: one optimizer step {why} (trainer.max_param_norm_ratio={bound:g}): training diverged, "
            f"likely from too large a learning rate (lr={self.optim.lr:g}). The run stops before this step's weights "
            "reach the engine or a checkpoint; resume from the last checkpoint with a lower trainer.lr"
        )

    def weights_finite(self) -> bool:
        """Whether every parameter is finite on every rank (collective)."""
        ok = torch.tensor(1.0, device=self.device)
        for p in self.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.numel() and not torch.isfinite(local).all():
                ok.zero_()
                break
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    @torch.no_grad()
    def iter_full_params(self):
        """(HF name, full tensor) for every parameter, gathered from the FSDP shards one at a time (collective)."""
        for name, p in self.model.named_parameters():
            yield name, (p.full_tensor() if hasattr(p, "full_tensor") else p)

    # -- checkpoints ----------------------------------------------------------------------
    @property
    def has_frozen_params(self) -> bool:
        """Whether part of the model does not train (a LoRA base): checkpoints leave that part out."""
        return any(not p.requires_grad for p in self.model.parameters())

    def save(self, path: str | Path) -> None:
        """Model (its trained part), optimizer, scheduler and RNG of this rank into `path` (collective); never
        non-finite weights."""
        if not self.weights_finite():
            raise HybridRLError(
                f"{self.name}: refusing to write a checkpoint: its weights hold NaN or inf values; "
                "the last checkpoint on disk stays the newest"
            )
        reshard_units(self.model)  # a forward at world size 1 leaves full copies, which the state-dict API trips on
        save_trainer(self.model, self.optimizer, self.scheduler, path, trainable_only=self.has_frozen_params)

    def load(self, path: str | Path) -> None:
        """Restore everything `save` wrote (collective); the configured lr applies to the restored optimizer and
        schedule (a changed lr is one of the keys a resume may change); frozen parameters keep what `model.path`
        gave them."""
        reshard_units(self.model)
        load_trainer(
            self.model, self.optimizer, self.scheduler, path, lr=self.optim.lr, trainable_only=self.has_frozen_params
        )
