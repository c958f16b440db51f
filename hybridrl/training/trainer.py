"""The FSDP2 trainer: the training copy of the policy (and the frozen reference), AdamW, updates.

Its part of one iteration::

    old_logp, ref_logp = trainer.compute_logprobs(batch)      # phase "logprob"
    metrics = trainer.update(batch)                           # phase "update"
    for layer in trainer.iter_full_layers(): ...              # phase "reshard" (gather for the engine)
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from hybridrl.algorithms import (
    AlgorithmConfig,
    aggregate,
    aggregation_denominator,
    broadcast_to_tokens,
    kl_penalty,
    masked_mean,
    ppo_clip_loss,
    truncated_is_weights,
)
from hybridrl.batch import Batch
from hybridrl.models.config import ModelConfig
from hybridrl.models.loading import load_causal_lm
from hybridrl.training.checkpoint import load_trainer, save_trainer
from hybridrl.training.config import TrainerConfig
from hybridrl.training.logprobs import response_logprobs
from hybridrl.training.offload import HostOffloader
from hybridrl.training.schedule import build_scheduler

log = logging.getLogger(__name__)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of an HF causal LM (wrapped one FSDP unit each)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise NotImplementedError(f"cannot find decoder layers in {type(model).__name__} (expected model.model.layers)")
    return list(layers)


def shard_model(model: torch.nn.Module, mesh, mp: MixedPrecisionPolicy | None) -> torch.nn.Module:
    """fully_shard each decoder layer, then the root (embeddings, final norm, lm_head).

    Layer units bound memory (one layer gathered at a time) and overlap its all-gather with compute. On
    one rank there is nothing to shard or to communicate, so the root is the only unit: one gather-and-cast
    per forward and one gradient reduction per backward instead of one per layer (on the H200 the per-unit
    hooks took about a fifth of a 1.5B update's CPU time, and the update was CPU-bound). Parameters stay
    DTensors with mixed precision either way.
    """
    kwargs = {"mesh": mesh, "reshard_after_forward": mesh.size() > 1}
    if mp is not None:
        kwargs["mp_policy"] = mp
    if mesh.size() > 1:
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def reshard_units(root: torch.nn.Module) -> None:
    """Every FSDP unit under `root` back to sharded storage (frees gathered copies kept after a forward)."""
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def compile_layers(model: torch.nn.Module) -> None:
    """torch.compile the forward of every decoder layer (before FSDP wraps them).

    Only the layer's own computation is compiled: FSDP2's gather/free hooks run around it in eager mode.
    All layers share one code object, so they share the compiled graphs (parameters are graph inputs).
    If compiling fails on this machine (no compiler, an unsupported op), PyTorch warns and runs eagerly.
    """
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=None)


class Trainer:
    """FSDP2 policy (+ optional frozen reference) with AdamW and a warmup/cosine schedule."""

    def __init__(
        self,
        model_path: str,
        model_cfg: ModelConfig,
        cfg: TrainerConfig,
        algo: AlgorithmConfig,
        device: torch.device,
        pad_token_id: int,
        temperature: float,
        total_optimizer_steps: int,
    ) -> None:
        self.cfg, self.algo, self.device = cfg, algo, device
        self.pad_token_id, self.temperature = pad_token_id, temperature
        self.world = dist.get_world_size()
        self.mesh = init_device_mesh(device.type, (self.world,), mesh_dim_names=("fsdp",))
        compute = cfg.param_dtype if cfg.param_dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
        mp = None
        if compute == "bfloat16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # Master weights stay float32; FSDP casts them to the compute dtype at each gather.
        model = load_causal_lm(model_path, model_cfg, torch.float32, device)
        if model_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        use_compile = cfg.compile and device.type == "cuda"
        if use_compile and model_cfg.gradient_checkpointing:
            log.info("trainer.compile is not applied with model.gradient_checkpointing (not tested together)")
            use_compile = False
        if use_compile:
            compile_layers(model)
        self.model = shard_model(model, self.mesh, mp)
        self.ref = None
        if algo.uses_reference:
            # Frozen, so no float32 master copy: stored in the compute dtype (what FSDP would cast it to anyway),
            # which halves its memory and the bytes it moves at each offload.
            ref_dtype = torch.bfloat16 if mp is not None else torch.float32
            ref = load_causal_lm(model_path, model_cfg, ref_dtype, device).eval().requires_grad_(False)
            if use_compile:
                compile_layers(ref)
            self.ref = shard_model(ref, self.mesh, mp)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
            fused=True if cfg.fused_optimizer and device.type == "cuda" else None,
        )
        self.scheduler = build_scheduler(self.optimizer, cfg.warmup_steps, total_optimizer_steps, cfg.lr_schedule, cfg.min_lr_ratio)
        parts = cfg.offload_parts()
        if parts and device.type != "cuda":
            log.info("trainer.offload=%s has no effect on %s (nothing to free)", cfg.offload, device.type)
        offload_params = "params" in parts and device.type == "cuda"
        self.param_offload = HostOffloader(lambda: list(self.model.parameters()), device, enabled=offload_params)
        # The reference moves on its own schedule: back in behind the policy's log-prob passes, out right after its own.
        self.ref_offload = HostOffloader(
            lambda: list(self.ref.parameters()) if self.ref is not None else [], device, enabled=offload_params
        )
        self.optim_offload = HostOffloader(
            lambda: [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)], device,
            enabled=("optimizer" in parts and device.type == "cuda"),
        )

    # -- memory ---------------------------------------------------------------------------
    def offload(self) -> dict[str, float]:
        """Parameters and/or optimizer state to pinned host memory (per trainer.offload) for the rollout.
        The reference's copy, started right after its log-prob pass, is completed here."""
        self.reshard_all()
        return self._timed("offload", self.ref_offload.complete, self.param_offload.offload, self.optim_offload.offload)

    def reshard_all(self) -> None:
        """Back to sharded storage in every FSDP unit (layers stay unsharded after a forward at world size 1,
        the root after any forward): offload must move shards, not a full copy."""
        for root in (self.model, self.ref):
            if root is not None:
                reshard_units(root)

    def onload_params(self) -> dict[str, float]:
        """Policy parameters back on the device (before log-probs). The reference and then the optimizer state
        start coming back too, on side streams, so their copies overlap the policy's log-prob passes."""
        stats = self._timed("onload_params", self.param_offload.onload)
        t0 = time.perf_counter()
        for name, offloader in (("ref", self.ref_offload), ("optim", self.optim_offload)):
            moved = offloader.onload(wait=False)
            if moved:
                stats[f"trainer/onload_{name}_gb"] = moved / 1e9
                stats["trainer/onload_async_issue_s"] = time.perf_counter() - t0
        return stats

    def onload_optimizer(self) -> dict[str, float]:
        """Optimizer state on the device before the update (joins the copy `onload_params` started)."""
        if not self.optim_offload.enabled:
            return {}
        t0 = time.perf_counter()
        moved = self.optim_offload.onload()  # nothing left unless onload_params was skipped
        self.optim_offload.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return {"trainer/onload_optim_wait_s": time.perf_counter() - t0, **({"trainer/onload_optim_gb": moved / 1e9} if moved else {})}

    def _timed(self, what: str, *moves) -> dict[str, float]:
        t0 = time.perf_counter()
        moved = sum(m() for m in moves)
        if moved and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        if not moved:
            return {}
        # No empty_cache here: the engine allocates from the same caching allocator, and releasing
        # tens of GB of cached blocks to the driver took seconds (seen: 3.4 s at 1.5B).
        return {f"trainer/{what}_s": dt, f"trainer/{what}_gb": moved / 1e9, f"trainer/{what}_gbps": moved / 1e9 / max(dt, 1e-9)}

    # -- log-probs ------------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Old (this policy, before the update) and reference log-probs of the response tokens, and the
        policy's per-token entropy (the `actor/entropy` metric)."""
        out: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.model.eval()
        # Device copies of each micro-batch's tokens, shared by the policy and reference passes.
        micro = [(mb, mb["responses"].to(self.device), mb["response_mask"].to(self.device))
                 for mb in batch.chunks(self.cfg.micro_batch_size)]
        # All policy passes first: the reference's onload runs behind them.
        for mb, resp, mask in micro:
            lp, ent = self._logprobs(self.model, mb, resp, mask, with_entropy=True)
            out["old_logprobs"].append(lp.cpu())
            out["entropy"].append(ent.cpu())
        if self.ref is not None:
            self.ref_offload.onload()  # a no-op after onload_params, except to cancel an unfinished offload
            self.ref_offload.wait()
            for mb, resp, mask in micro:
                out["ref_logprobs"].append(self._logprobs(self.ref, mb, resp, mask)[0].cpu())
            if self.ref_offload.enabled:
                # Out again at once, behind the update; `offload` frees its memory once the copy is done.
                reshard_units(self.ref)
                self.ref_offload.offload(wait=False)
        return {k: torch.cat(v) for k, v in out.items()}

    def _logprobs(self, model: torch.nn.Module, mb: Batch, resp: torch.Tensor, mask: torch.Tensor,
                  with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`response_logprobs` of one micro-batch with this trainer's temperature, padding and kernels."""
        return response_logprobs(model, mb.prompts, resp, mask, self.temperature, self.pad_token_id,
                                 with_entropy=with_entropy, chunk_size=self.cfg.logprob_chunk_size,
                                 kernel=self.cfg.fused_logprobs)

    # -- update ---------------------------------------------------------------------------
    def _global_sum(self, value: torch.Tensor) -> torch.Tensor:
        value = value.to(self.device, torch.float32)
        if self.world > 1:
            dist.all_reduce(value)
        return value

    def update(self, batch: Batch) -> dict[str, float]:
        """PPO-clip epochs over this rank's shard of the batch; returns averaged actor metrics."""
        cfg, algo = self.cfg, self.algo
        self.model.train()
        n_local = len(batch)
        mini = n_local if cfg.mini_batch_size == 0 else max(1, cfg.mini_batch_size // self.world)
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)

        def record(key: str, value: float) -> None:
            sums[key] += float(value)
            counts[key] += 1

        for _epoch in range(cfg.ppo_epochs):
            for mb_batch in batch.chunks(mini):
                micro = mb_batch.chunks(cfg.micro_batch_size)
                # Normalize by the whole mini-batch over all ranks, so accumulation over
                # micro-batches and FSDP's gradient averaging over ranks equal one big batch.
                denom = sum(aggregation_denominator(m["response_mask"], algo.loss_agg_mode) for m in micro)
                normalizer = self._global_sum(torch.as_tensor(denom)) / self.world
                for m in micro:
                    metrics = self._micro_step(m, normalizer)
                    for k, v in metrics.items():
                        record(k, v)
                grad_norm = self._optimizer_step()
                record("actor/grad_norm", grad_norm)
        out = {k: sums[k] / counts[k] for k in sums}
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        return out

    def _micro_step(self, mb: Batch, normalizer: torch.Tensor) -> dict[str, float]:
        algo = self.algo
        resp, mask = mb["responses"].to(self.device), mb["response_mask"].to(self.device).float()
        # The entropy needs a full softmax over the vocabulary: in the graph only when it is in the loss;
        # as a metric it comes from the no-grad log-prob pass (`compute_logprobs`).
        with_entropy = algo.entropy_coef > 0
        logp, entropy = self._logprobs(self.model, mb, resp, mask, with_entropy=with_entropy)
        old = mb["old_logprobs"].to(self.device)
        adv = broadcast_to_tokens(mb["advantages"].to(self.device), mask)
        is_w = None
        if algo.rollout_correction == "tis":
            is_w = truncated_is_weights(old, mb["engine_logprobs"].to(self.device), mask, algo.rollout_correction_cap)
        loss, pm = ppo_clip_loss(
            logp, old, adv, mask, algo.clip_ratio_low, algo.clip_ratio_high, algo.clip_ratio_c,
            algo.loss_agg_mode, normalizer=normalizer, is_weights=is_w,
        )
        metrics = {"actor/pg_loss": loss.item(), **{f"actor/{k}": float(v) for k, v in pm.items()}}
        if self.ref is not None:
            kl = kl_penalty(logp, mb["ref_logprobs"].to(self.device), algo.kl_estimator)
            metrics["actor/kl"] = masked_mean(kl, mask).item()
            if algo.kl_in == "loss":
                kl_loss = aggregate(kl, mask, algo.loss_agg_mode, normalizer=normalizer)
                loss = loss + algo.kl_coef * kl_loss
        if with_entropy:
            loss = loss - algo.entropy_coef * aggregate(entropy, mask, algo.loss_agg_mode, normalizer=normalizer)
            metrics["actor/entropy_in_update"] = masked_mean(entropy.detach(), mask).item()
        loss.backward()
        return metrics

    def _optimizer_step(self) -> float:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if torch.isfinite(norm):
            self.optimizer.step()
        else:
            log.warning("non-finite gradient norm %s: optimizer step skipped", norm.item())
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm.item()

    # -- weights for the engine ----------------------------------------------------------
    @torch.no_grad()
    def iter_full_params(self):
        """(HF name, full tensor) for every parameter, gathered from the FSDP shards one at a time."""
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield name, full

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Model, optimizer, scheduler and RNG of this rank into `path` (collective)."""
        save_trainer(self.model, self.optimizer, self.scheduler, path)

    def load(self, path: str) -> None:
        """Restore everything `save` wrote (collective)."""
        load_trainer(self.model, self.optimizer, self.scheduler, path)
