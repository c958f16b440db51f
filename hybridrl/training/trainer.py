"""The actor: the FSDP2 training copy of the policy, its log-probs and its policy-gradient update.

Its part of one iteration (the worker calls these; the reference and the engine are separate roles)::

    micro = trainer.micro_batches(batch)                     # phase "logprob": packed once, shared with the ref
    old_logp, entropy = trainer.compute_logprobs(micro)
    ref_logp = trainer.compute_ref_logprobs(micro)           # with LoRA only: the base, adapters off
    metrics = trainer.update(batch)                          # phase "update"
    resharder.sync(trainer.model)                            # phase "reshard" (gathers full layers for the engine)
"""

from __future__ import annotations

import time
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
from hybridrl.training.logprobs import packed_logprobs, response_logprobs
from hybridrl.training.lora import check_target_modules, lora_memory_stats, wrap_with_lora
from hybridrl.training.micro_batches import MicroBatch, make_micro_batches, scatter_rows
from hybridrl.training.pass_meter import PassMeter
from hybridrl.training.sequence_parallel import SequenceParallel
from hybridrl.training.ulysses import use_training_attention
from hybridrl.training.vision import check_vision_training, prepare_policy, vision_packer


def attention_mask(mb: Batch) -> torch.Tensor | None:
    """Every real response token (agent trajectories: model and tool tokens), where it differs from the loss mask;
    None for single-turn rollouts, whose response mask is both."""
    return mb["response_attention_mask"] if "response_attention_mask" in mb else None


def model_logprobs(
    model: torch.nn.Module, m: MicroBatch, cfg: TrainerConfig, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) [rows, R] of one micro-batch's response tokens, packed or padded as it was built,
    with the trainer's temperature and kernels."""
    if m.packed is not None:
        return packed_logprobs(
            model, m.packed, temperature, with_entropy, chunk_size=cfg.logprob_chunk_size, kernel=cfg.fused_logprobs
        )
    attn = attention_mask(m.batch)
    return response_logprobs(
        model,
        m.batch.prompts,
        m.responses,
        m.mask,
        temperature,
        m.pad_id,
        with_entropy=with_entropy,
        chunk_size=cfg.logprob_chunk_size,
        kernel=cfg.fused_logprobs,
        attention_mask=None if attn is None else attn.to(m.device),
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
        sequence_parallel: SequenceParallel | None = None,
    ) -> None:
        self.cfg, self.algo = cfg, algo
        self.pad_token_id, self.temperature = pad_token_id, temperature
        self.world = mesh.size()
        #: This rank's SP group (`training/sequence_parallel.py`); its ranks hold the same rows.
        self.sequence_parallel = sequence_parallel
        self.dp_size = self.world // (sequence_parallel.size if sequence_parallel is not None else 1)
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
        sp_size = sequence_parallel.size if sequence_parallel is not None else 1
        use_training_attention(model, cfg, model_cfg.attn_implementation, sp_size)
        prepare_policy(model, model_cfg, trains=True)  # a vision-language model's tower (training/vision.py)
        #: Adds images and mrope positions to a vision-language policy's micro-batches; None for a text model.
        self.vision = vision_packer(model)
        if self.vision is not None:
            check_vision_training(cfg.padding_free, sp_size)
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
        #: Tokens, padding and time of the step's trainer passes (shared with the reference and critic on a worker).
        self.meter = PassMeter()

    # -- log-probs ------------------------------------------------------------------------
    def micro_batches(self, batch: Batch) -> list[MicroBatch]:
        """This rank's log-prob micro-batches of `batch` (`trainer.logprob_batching`), packed on its device
        (collective under a token budget)."""
        return make_micro_batches(
            batch, self.cfg.logprob_batching(), self.device, self.pad_token_id, self.sequence_parallel, self.vision
        )

    @torch.no_grad()
    def compute_logprobs(self, micro: list[MicroBatch]) -> dict[str, torch.Tensor]:
        """Old (this policy, before the update) log-probs of the response tokens and the policy's per-token
        entropy (the `actor/entropy` metric), in the batch's row order. The step's first trainer pass."""
        self.meter.start_step()
        self.model.eval()
        logps, ents = [], []
        with self.meter.timed(micro):
            for m in micro:
                lp, ent = model_logprobs(self.model, m, self.cfg, self.temperature, with_entropy=True)
                logps.append(lp.cpu())
                ents.append(ent.cpu())
        n = sum(len(m.rows) for m in micro)
        return {"old_logprobs": scatter_rows(logps, micro, n), "entropy": scatter_rows(ents, micro, n)}

    @torch.no_grad()
    def compute_ref_logprobs(self, micro: list[MicroBatch]) -> dict[str, torch.Tensor]:
        """Reference log-probs with LoRA: the same model with its adapters disabled, i.e. the frozen base."""
        if self.peft is None:
            raise RuntimeError("the actor scores the reference only with LoRA (model.lora); use the ref role")
        self.model.eval()
        with self.peft.disable_adapter(), self.meter.timed(micro):
            out = [model_logprobs(self.model, m, self.cfg, self.temperature)[0].cpu() for m in micro]
        return {"ref_logprobs": scatter_rows(out, micro, sum(len(m.rows) for m in micro))}

    def memory_stats(self) -> dict[str, float]:
        """The learner's figures, and with LoRA the adapter / frozen-base split."""
        stats = super().memory_stats()
        if self.peft is not None:
            stats.update(lora_memory_stats(self.model))
        return stats

    # -- update ---------------------------------------------------------------------------
    def update(self, batch: Batch) -> dict[str, float]:
        """PPO-clip epochs over this rank's shard of the batch; returns the actor's metrics.

        `actor/pg_loss` is each mini-batch's loss (the sum of its micro-batches' shares, averaged over mini-batches
        and epochs); the per-token figures (clip fractions, ppo_kl, ratio_mean, kl) are token-weighted over all
        ranks; so neither depends on how rows were split into micro-batches or over workers."""
        cfg, algo = self.cfg, self.algo
        self.model.train()
        n_local = len(batch)
        mini = n_local if cfg.mini_batch_size == 0 else max(1, cfg.mini_batch_size // self.dp_size)
        skipped_before = self.nonfinite_total
        sums: dict[str, float] = defaultdict(float)
        weighted: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # key -> [sum of value * tokens, tokens]
        steps = 0
        t0, passes = time.perf_counter(), []
        for _epoch in range(cfg.ppo_epochs):
            for mb_batch in batch.chunks(mini):
                micro = make_micro_batches(
                    mb_batch, cfg.update_batching(), self.device, self.pad_token_id, self.sequence_parallel, self.vision
                )
                passes += micro
                # Normalize by the whole mini-batch over all ranks, so accumulation over micro-batches and FSDP's
                # gradient averaging over ranks equal one big batch. Under sequence parallelism every rank of a
                # group adds its group's denominator: the sum over all ranks / world is the sum over dp ranks / dp
                # (`training/sequence_parallel.py` says why the gradient comes out as at sp=1).
                denom = aggregation_denominator(loss_mask(mb_batch), algo.loss_agg_mode)
                normalizer = self._global_sum(torch.as_tensor(denom)) / self.world
                for i, m in enumerate(micro):
                    self._gradient_sync(last_micro_batch=i == len(micro) - 1)
                    share, stats = self._micro_step(m, normalizer)
                    sums["actor/pg_loss"] += share
                    for k, (value, tokens) in stats.items():
                        weighted[k][0] += value * tokens
                        weighted[k][1] += tokens
                sums["actor/grad_norm"] += self.optimizer_step()
                steps += 1
        self.meter.record(passes, time.perf_counter() - t0)
        out = {k: v / steps for k, v in sums.items()}
        keys = sorted(weighted)  # the same on every rank: they follow the config and the batch's keys
        if keys:
            totals = self._global_sum(torch.tensor([weighted[k] for k in keys])).tolist()
            out.update({k: s / max(n, 1.0) for k, (s, n) in zip(keys, totals)})
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        out["actor/nonfinite_steps"] = self.nonfinite_total - skipped_before
        out.update(self.meter.metrics())
        return out

    def _gradient_sync(self, last_micro_batch: bool) -> None:
        """With `trainer.defer_grad_sync` on several ranks, only the last micro-batch's backward reduce-scatters:
        the others accumulate unsharded gradients locally (the sum is the same)."""
        if self.world > 1 and self.cfg.defer_grad_sync:
            self.model.set_requires_gradient_sync(last_micro_batch)

    def _micro_step(self, m: MicroBatch, normalizer: torch.Tensor) -> tuple[float, dict[str, tuple[float, float]]]:
        """Forward and backward of one micro-batch: its share of the mini-batch loss, and each per-token metric
        with the number of tokens it is the mean over."""
        algo, mb = self.algo, m.batch
        mask = m.mask.float()
        # The entropy needs a full softmax over the vocabulary: in the graph only when it is in the loss;
        # as a metric it comes from the no-grad log-prob pass (`compute_logprobs`).
        with_entropy = algo.entropy_coef > 0
        logp, entropy = model_logprobs(self.model, m, self.cfg, self.temperature, with_entropy=with_entropy)
        old = mb["old_logprobs"].to(self.device)
        # Tokens a rollout correction dropped are out of every term of the loss and of its normalizer.
        lmask = loss_mask(mb).to(self.device).float()
        is_w = mb["is_weights"].to(self.device) if "is_weights" in mb else None
        loss, pm = policy_loss(algo, logp, old, mb["advantages"].to(self.device), lmask, normalizer, is_weights=is_w)
        share = loss.item()
        n_loss, n_resp = lmask.sum().item(), mask.sum().item()
        metrics = {f"actor/{k}": (float(v), n_loss) for k, v in pm.items()}
        if "ref_logprobs" in mb:
            kl = kl_penalty(logp, mb["ref_logprobs"].to(self.device), algo.kl_estimator)
            metrics["actor/kl"] = (masked_mean(kl, mask).item(), n_resp)
            if algo.kl_in_loss:
                kl_loss = aggregate(kl, lmask, algo.loss_agg_mode, normalizer=normalizer)
                loss = loss + algo.kl_coef * kl_loss
        if with_entropy:
            loss = loss - algo.entropy_coef * aggregate(entropy, lmask, algo.loss_agg_mode, normalizer=normalizer)
            metrics["actor/entropy_in_update"] = (masked_mean(entropy.detach(), mask).item(), n_resp)
        loss.backward()
        return share, metrics


def loss_mask(mb: Batch) -> torch.Tensor:
    """The tokens the loss covers: the response mask, less what a masked rollout correction dropped."""
    return mb["loss_mask"] if "loss_mask" in mb else mb["response_mask"]
