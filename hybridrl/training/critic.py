"""The critic: an FSDP2 value model (the policy's architecture with a scalar head) for algorithm=ppo.

Its part of one iteration (the worker calls these; memory moves behind other roles' work where it can)::

    critic.onload_params(wait=False)        # phase "logprob": comes back behind the actor's log-prob passes
    values = critic.compute_values(micro)   # phase "values": V(s_t) before every response token
    critic.onload_optimizer(wait=False)     #   Adam state comes back behind that pass
    metrics = critic.update(batch)          # phase "update_critic": clipped value loss towards GAE's returns
    critic.offload(wait=False)              #   copies start (freed before the actor's update if it needs the room)
    critic.offload()                        # phase "wake": completes that copy, frees the device memory

Values follow verl's convention: the value of response token t is the head's output at the position of the token
before it (prompt_len - 1 + t), i.e. V(prompt + response[:t]), the state in which token t was chosen.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager

import torch

from hybridrl.algorithms import AlgorithmConfig, aggregation_denominator, clipped_value_loss
from hybridrl.batch import Batch
from hybridrl.models.config import ModelConfig
from hybridrl.models.quiet import no_progress_bars
from hybridrl.training.config import TrainerConfig
from hybridrl.training.critic_config import CriticConfig
from hybridrl.training.fsdp import Precision, compile_layers, reshard_units, shard_model, use_compile
from hybridrl.training.learner import FSDPLearner
from hybridrl.training.logprobs import pad_sequences
from hybridrl.training.micro_batches import MicroBatch, make_micro_batches, scatter_rows
from hybridrl.training.offload import timed_moves
from hybridrl.training.packing import PackedRows
from hybridrl.training.pass_meter import PassMeter
from hybridrl.training.sequence_parallel import SequenceParallel, SequenceShard
from hybridrl.training.ulysses import use_training_attention

log = logging.getLogger(__name__)
# The value head's [B, L, 1] output reaches us as a view; we never modify it in place, which is what FSDP2 warns of.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def load_value_model(path: str, model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device, head_seed: int):
    """`path` as a token-classification model with one label: the causal LM's body and a scalar head (a fresh head
    drawn from `head_seed`, so every rank, and every run with that seed, starts from the same one). Dropout in the
    head is off, as in verl's critic: the values of one state must not change between passes."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    with torch.random.fork_rng(devices=[]), quiet_transformers(), no_progress_bars():
        torch.manual_seed(head_seed)
        model, info = AutoModelForTokenClassification.from_pretrained(
            path,
            config=config,
            dtype=dtype,
            attn_implementation=model_cfg.attn_implementation,
            trust_remote_code=model_cfg.trust_remote_code,
            output_loading_info=True,
        )
    if info.get("missing_keys"):
        log.info(
            "critic: %s has no value head; a fresh one (%s) was drawn with seed %d",
            path,
            ", ".join(sorted(info["missing_keys"])),
            head_seed,
        )
    return model.to(device)


@contextmanager
def quiet_transformers():
    """transformers' loading report at error level only: a causal LM loaded as a value model always misses its head
    (said once in our own log line instead)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def response_values(
    model: torch.nn.Module, prompts: list[list[int]], responses: torch.Tensor, response_mask: torch.Tensor, pad_id: int
) -> torch.Tensor:
    """The value model's V(s_t) for every response token, response-aligned [B, R] in float32, 0 at padding.

    Rows are right-padded (`pad_sequences`); token t of row i is scored at position plen_i - 1 + t, the
    last token of the state it was sampled in (verl: `values[:, -response_length - 1 : -1]` on left-padded rows).
    """
    device = responses.device
    ids, attn, plens = pad_sequences(prompts, responses, response_mask, pad_id)
    out = model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False).logits[..., 0].float()
    R = responses.shape[1]
    idx = torch.tensor(plens, device=device)[:, None] - 1 + torch.arange(R, device=device)[None, :]
    values = out.gather(1, idx.clamp(max=out.shape[1] - 1))
    mask = response_mask.to(device)
    return torch.where(mask > 0, values, torch.zeros_like(values))


def packed_values(model: torch.nn.Module, packed: PackedRows | SequenceShard) -> torch.Tensor:
    """`response_values` of a packed micro-batch (or a rank's sequence-parallel slice of one): the head's output at
    the position before each masked response token (`PackedRows.kept`), response-aligned [rows, R] in float32, 0
    elsewhere."""
    out = model(**packed.model_inputs(), use_cache=False).logits[0, :, 0].float()
    return packed.scatter(out[packed.kept])


def micro_values(model: torch.nn.Module, m: MicroBatch) -> torch.Tensor:
    """V(s_t) [rows, R] of one micro-batch, packed or padded as it was built."""
    if m.packed is not None:
        return packed_values(model, m.packed)
    return response_values(model, m.batch.prompts, m.responses, m.mask, m.pad_id)


class Critic(FSDPLearner):
    """The critic role: value model, AdamW and schedule of its own, host offload, checkpoints (`critic/`)."""

    name = "critic"

    def __init__(
        self,
        model_path: str,
        model_cfg: ModelConfig,
        cfg: CriticConfig,
        trainer: TrainerConfig,
        algo: AlgorithmConfig,
        device: torch.device,
        mesh,
        pad_token_id: int,
        total_optimizer_steps: int,
        head_seed: int = 0,
        sequence_parallel: SequenceParallel | None = None,
    ) -> None:
        self.cfg, self.algo, self.pad_token_id = cfg, algo, pad_token_id
        self.mini_batch_size, self.micro_batch_size, self.ppo_epochs = cfg.batching(trainer)
        self.micro_batching = cfg.micro_batching(trainer)
        self.world = mesh.size()
        self.sequence_parallel = sequence_parallel  # the actor's SP group: its ranks hold the same rows
        sp_size = sequence_parallel.size if sequence_parallel is not None else 1
        self.dp_size = self.world // sp_size
        precision = Precision.for_device(trainer.param_dtype, device)
        model = load_value_model(model_path, model_cfg, torch.float32, device, head_seed)
        use_training_attention(model, trainer, model_cfg.attn_implementation, sp_size)
        if model_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if use_compile(trainer.compile, model_cfg.gradient_checkpointing, device):
            compile_layers(model)
        super().__init__(
            shard_model(model, mesh, precision.policy),
            cfg.optim(trainer),
            cfg.offload_parts(trainer),
            device,
            total_optimizer_steps,
        )
        self.meter = PassMeter()  # the actor's, on a worker (`workers/build.py`)

    # -- memory (the base class moves synchronously; the critic's copies hide behind other roles) ----
    def onload_params(self, wait: bool = True) -> dict[str, float]:
        """Parameters back on the device; with wait=False on a side stream, joined by `compute_values`."""
        if wait:
            return super().onload_params()
        moved = self.param_offload.onload(wait=False)
        return {"offload/critic/onload_params_gb": moved / 1e9} if moved else {}

    def offload(self, wait: bool = True) -> dict[str, float]:
        """Parameters and Adam state to host memory (per the offload policy). wait=False starts the copies and
        returns; wait=True completes copies in flight (or makes them) and frees the device memory."""
        reshard_units(self.model)
        if not wait:
            self.param_offload.offload(wait=False)
            self.optim_offload.offload(wait=False)
            return {}
        return timed_moves(
            "offload/critic/offload", self.device, self.param_offload.complete, self.optim_offload.complete
        )

    def _join_params(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.param_offload.onload()  # a no-op after onload(wait=False), except to cancel an unfinished offload
        self.param_offload.wait()
        if self.device.type == "cuda" and self.param_offload.enabled:
            torch.cuda.current_stream(self.device).synchronize()
            return {"offload/critic/onload_params_wait_s": time.perf_counter() - t0}
        return {}

    # -- values ---------------------------------------------------------------------------
    def micro_batches(self, batch: Batch) -> list[MicroBatch]:
        """The critic's micro-batches of `batch`, packed on its device (collective under a token budget)."""
        return make_micro_batches(batch, self.micro_batching, self.device, self.pad_token_id, self.sequence_parallel)

    @torch.no_grad()
    def compute_values(self, micro: list[MicroBatch]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The rollout's values [B, R] (what GAE and the value clip use), and the onload wait it joined first."""
        stats = self._join_params()
        self.model.eval()
        with self.meter.timed(micro):
            out = [micro_values(self.model, m).cpu() for m in micro]
        return {"values": scatter_rows(out, micro, sum(len(m.rows) for m in micro))}, stats

    # -- update ---------------------------------------------------------------------------
    def update(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss epochs over this rank's shard (needs `values` and `returns` in it); critic metrics.

        The loss is aggregated like the policy loss (`algorithm.loss_agg_mode`, one normalizer per mini-batch over
        all ranks). `critic/value_loss` is each mini-batch's whole loss (the sum of its micro-batches' shares),
        `critic/vf_clipfrac` and `critic/vpred_mean` are token-weighted over all ranks, so 1 or N workers log the
        same numbers."""
        mode = self.algo.loss_agg_mode
        self._join_params()  # whatever happened since the values pass, the update must see the device copy
        self.model.train()
        mini = len(batch) if self.mini_batch_size == 0 else max(1, self.mini_batch_size // self.dp_size)
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        tokens = torch.zeros(3)  # clipped tokens, sum of predictions, tokens
        t0, passes = time.perf_counter(), []
        for _epoch in range(self.ppo_epochs):
            for mb_batch in batch.chunks(mini):
                micro = self.micro_batches(mb_batch)
                passes += micro
                denom = aggregation_denominator(mb_batch["response_mask"], mode)
                # Over all ranks / world: under sequence parallelism the sum over dp ranks / dp (as the actor's).
                normalizer = self._global_sum(torch.as_tensor(denom)) / self.world
                loss_sum = 0.0
                for m in micro:
                    loss, mask, lm = self._micro_step(m, normalizer)
                    loss_sum += loss
                    n = mask.sum().item()
                    tokens += torch.tensor([lm["vf_clipfrac"].item() * n, lm["vpred_mean"].item() * n, n])
                sums["critic/value_loss"] += loss_sum
                counts["critic/value_loss"] += 1
                sums["critic/grad_norm"] += self.optimizer_step()
                counts["critic/grad_norm"] += 1
        self.meter.record(passes, time.perf_counter() - t0)
        out = {k: sums[k] / counts[k] for k in sums}
        tokens = self._global_sum(tokens).tolist()
        out["critic/vf_clipfrac"] = tokens[0] / max(tokens[2], 1.0)
        out["critic/vpred_mean"] = tokens[1] / max(tokens[2], 1.0)
        out["critic/lr"] = self.scheduler.get_last_lr()[0]
        out.update(self.meter.metrics())  # the actor's update, when it runs, reports the whole step's
        return out

    def _micro_step(
        self, m: MicroBatch, normalizer: torch.Tensor
    ) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
        mb, mask = m.batch, m.mask.float()
        vpred = micro_values(self.model, m)
        loss, metrics = clipped_value_loss(
            vpred,
            mb["values"].to(self.device),
            mb["returns"].to(self.device),
            mask,
            self.cfg.cliprange_value,
            self.algo.loss_agg_mode,
            normalizer=normalizer,
        )
        loss.backward()
        return loss.item(), mask, metrics
