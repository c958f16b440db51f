"""The actor: the FSDP2 training copy of the policy, its log-probs and its policy-gradient update.

Its part of one iteration (the worker calls these; the reference and the engine are separate roles)::

    micro = trainer.micro_batches(batch)                     # phase "logprob": device copies, shared with the ref
    old_logp, entropy = trainer.compute_logprobs(micro)
    ref_logp = trainer.compute_ref_logprobs(micro)           # with LoRA only: the base, adapters off
    metrics = trainer.update(batch)                          # phase "update"
    resharder.sync(trainer.model)                            # phase "reshard" (gathers full layers for the engine)
"""

from __future__ import annotations

from collections import defaultdict

import torch

from hybridrl.algorithms import (
    AlgorithmConfig,
    aggregate,
    aggregation_denominator,
    kl_penalty,
    masked_mean,
    policy_loss,
)
from hybridrl.batch import Batch
from hybridrl.models.config import ModelConfig
from hybridrl.models.loading import load_causal_lm
from hybridrl.training.config import TrainerConfig
from hybridrl.training.fsdp import Precision, compile_layers, shard_model, use_compile
from hybridrl.training.learner import FSDPLearner
from hybridrl.training.logprobs import response_logprobs
from hybridrl.training.lora import check_target_modules, lora_memory_stats, wrap_with_lora

#: One micro-batch as the log-prob passes take it: the rows, and their responses and mask already on the device.
MicroBatch = tuple[Batch, torch.Tensor, torch.Tensor]


def micro_batches(batch: Batch, size: int, device: torch.device) -> list[MicroBatch]:
    """`batch` in chunks of `size` rows, each with device copies of its responses and mask (made once, read by
    every model that scores the batch)."""
    return [(mb, mb["responses"].to(device), mb["response_mask"].to(device)) for mb in batch.chunks(size)]


def attention_mask(mb: Batch) -> torch.Tensor | None:
    """Every real response token (agent trajectories: model and tool tokens), where it differs from the loss mask;
    None for single-turn rollouts, whose response mask is both."""
    return mb["response_attention_mask"] if "response_attention_mask" in mb else None


def model_logprobs(
    model: torch.nn.Module,
    micro: MicroBatch,
    cfg: TrainerConfig,
    temperature: float,
    pad_id: int,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs` of one micro-batch with the trainer's temperature, padding and kernels."""
    mb, resp, mask = micro
    attn = attention_mask(mb)
    return response_logprobs(
        model,
        mb.prompts,
        resp,
        mask,
        temperature,
        pad_id,
        with_entropy=with_entropy,
        chunk_size=cfg.logprob_chunk_size,
        kernel=cfg.fused_logprobs,
        attention_mask=None if attn is None else attn.to(resp.device),
    )


class Trainer(FSDPLearner):
    """The actor role: FSDP2 policy with AdamW and a warmup/cosine schedule, PPO-style updates."""

    name = "actor"

    def __init__(
        self,
        model_path: str,
        model_cfg: ModelConfig,
        cfg: TrainerConfig,
        algo: AlgorithmConfig,
        device: torch.device,
        mesh,
        pad_token_id: int,
        temperature: float,
        total_optimizer_steps: int,
    ) -> None:
        self.cfg, self.algo = cfg, algo
        self.pad_token_id, self.temperature = pad_token_id, temperature
        self.world = mesh.size()
        precision = Precision.for_device(cfg.param_dtype, device)
        self.peft = None
        if model_cfg.lora.enabled:
            # The base is frozen: stored like the reference (compute dtype), adapters in float32 (`training/lora.py`).
            check_target_modules(model_path, model_cfg)
            model = load_causal_lm(model_path, model_cfg, precision.frozen_dtype, device)
            self.peft = wrap_with_lora(model, model_cfg.lora, cfg.seed)
        else:
            # Master weights stay float32; FSDP casts them to the compute dtype at each gather.
            model = load_causal_lm(model_path, model_cfg, torch.float32, device)
        #: With LoRA and a KL term the actor scores the reference too: its base, adapters off (no second copy).
        self.serves_reference = self.peft is not None and algo.uses_reference
        if model_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if use_compile(cfg.compile, model_cfg.gradient_checkpointing, device):
            compile_layers(model)
        # One rank with LoRA: the frozen base (already in the compute dtype) stays outside FSDP, held once.
        frozen = None
        if self.peft is not None and self.world == 1:
            frozen = {p for p in model.parameters() if not p.requires_grad}
        model = shard_model(model, mesh, precision.policy, cfg.fsdp_layers_per_unit, cfg.reshard_after_forward, frozen)
        super().__init__(model, cfg, cfg.offload_parts(), device, total_optimizer_steps)

    # -- log-probs ------------------------------------------------------------------------
    def micro_batches(self, batch: Batch) -> list[MicroBatch]:
        """This trainer's micro-batches of `batch`, on its device."""
        return micro_batches(batch, self.cfg.micro_batch_size, self.device)

    @torch.no_grad()
    def compute_logprobs(self, micro: list[MicroBatch]) -> dict[str, torch.Tensor]:
        """Old (this policy, before the update) log-probs of the response tokens and the policy's per-token
        entropy (the `actor/entropy` metric)."""
        self.model.eval()
        logps, ents = [], []
        for m in micro:
            lp, ent = model_logprobs(self.model, m, self.cfg, self.temperature, self.pad_token_id, with_entropy=True)
            logps.append(lp.cpu())
            ents.append(ent.cpu())
        return {"old_logprobs": torch.cat(logps), "entropy": torch.cat(ents)}

    @torch.no_grad()
    def compute_ref_logprobs(self, micro: list[MicroBatch]) -> dict[str, torch.Tensor]:
        """Reference log-probs with LoRA: the same model with its adapters disabled, i.e. the frozen base."""
        if self.peft is None:
            raise RuntimeError("the actor scores the reference only with LoRA (model.lora); use the ref role")
        self.model.eval()
        with self.peft.disable_adapter():
            out = [model_logprobs(self.model, m, self.cfg, self.temperature, self.pad_token_id)[0].cpu() for m in micro]
        return {"ref_logprobs": torch.cat(out)}

    def memory_stats(self) -> dict[str, float]:
        """The learner's figures, and with LoRA the adapter / frozen-base split."""
        stats = super().memory_stats()
        if self.peft is not None:
            stats.update(lora_memory_stats(self.model))
        return stats

    # -- update ---------------------------------------------------------------------------
    def update(self, batch: Batch) -> dict[str, float]:
        """PPO-clip epochs over this rank's shard of the batch; returns averaged actor metrics."""
        cfg, algo = self.cfg, self.algo
        self.model.train()
        n_local = len(batch)
        mini = n_local if cfg.mini_batch_size == 0 else max(1, cfg.mini_batch_size // self.world)
        skipped_before = self.nonfinite_total
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
                denom = sum(aggregation_denominator(loss_mask(m), algo.loss_agg_mode) for m in micro)
                normalizer = self._global_sum(torch.as_tensor(denom)) / self.world
                for i, m in enumerate(micro):
                    self._gradient_sync(last_micro_batch=i == len(micro) - 1)
                    for k, v in self._micro_step(m, normalizer).items():
                        record(k, v)
                record("actor/grad_norm", self.optimizer_step())
        out = {k: sums[k] / counts[k] for k in sums}
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        out["actor/nonfinite_steps"] = self.nonfinite_total - skipped_before
        return out

    def _gradient_sync(self, last_micro_batch: bool) -> None:
        """With `trainer.defer_grad_sync` on several ranks, only the last micro-batch's backward reduce-scatters:
        the others accumulate unsharded gradients locally (the sum is the same)."""
        if self.world > 1 and self.cfg.defer_grad_sync:
            self.model.set_requires_gradient_sync(last_micro_batch)

    def _micro_step(self, mb: Batch, normalizer: torch.Tensor) -> dict[str, float]:
        algo = self.algo
        resp, mask = mb["responses"].to(self.device), mb["response_mask"].to(self.device).float()
        # The entropy needs a full softmax over the vocabulary: in the graph only when it is in the loss;
        # as a metric it comes from the no-grad log-prob pass (`compute_logprobs`).
        with_entropy = algo.entropy_coef > 0
        logp, entropy = model_logprobs(
            self.model, (mb, resp, mask), self.cfg, self.temperature, self.pad_token_id, with_entropy=with_entropy
        )
        old = mb["old_logprobs"].to(self.device)
        # Tokens a rollout correction dropped are out of every term of the loss and of its normalizer.
        lmask = loss_mask(mb).to(self.device).float()
        is_w = mb["is_weights"].to(self.device) if "is_weights" in mb else None
        loss, pm = policy_loss(algo, logp, old, mb["advantages"].to(self.device), lmask, normalizer, is_weights=is_w)
        metrics = {"actor/pg_loss": loss.item(), **{f"actor/{k}": float(v) for k, v in pm.items()}}
        if "ref_logprobs" in mb:
            kl = kl_penalty(logp, mb["ref_logprobs"].to(self.device), algo.kl_estimator)
            metrics["actor/kl"] = masked_mean(kl, mask).item()
            if algo.kl_in_loss:
                kl_loss = aggregate(kl, lmask, algo.loss_agg_mode, normalizer=normalizer)
                loss = loss + algo.kl_coef * kl_loss
        if with_entropy:
            loss = loss - algo.entropy_coef * aggregate(entropy, lmask, algo.loss_agg_mode, normalizer=normalizer)
            metrics["actor/entropy_in_update"] = masked_mean(entropy.detach(), mask).item()
        loss.backward()
        return metrics


def loss_mask(mb: Batch) -> torch.Tensor:
    """The tokens the loss covers: the response mask, less what a masked rollout correction dropped."""
    return mb["loss_mask"] if "loss_mask" in mb else mb["response_mask"]
