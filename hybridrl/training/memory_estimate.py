"""Peak device memory of each phase of a step, from the model's dimensions and the run's settings alone.

Arithmetic only (no model, no device): `hybridrl/plan.py` fills `MemoryInputs` from a config and prints the table;
the run checks it before any weights load. Per device, with W data-parallel ranks, P parameters, P_t of them
trained, b bytes per compute element (2 for bf16):

    parameters   4P/W float32 masters (a frozen LoRA base: bP/W), plus the gathered bP of the unit(s) in use
    gradients    4P_t/W float32 shards, plus bP_t unsharded during the backward; the reduction of each micro-batch's
                 gradients then holds a float32 copy of them and its float32 output shard (`reduce_bytes`), a moment
                 of its own when the whole model is one unit (one rank): the update's peak is the larger moment
    optimizer    AdamW's two moments, 8P_t/W; with the moments on the host (`trainer.optimizer_on_host`) only the
                 update's streaming slots of both moments, 16C bytes (C elements a chunk; 8P_t/W when that is less)
    activations  what autograd keeps per token and layer (`activation_bytes_per_token`) × the micro-batch's tokens
                 this device computes: all of them, or 1/sp with sequence parallelism (Ulysses: each rank runs its
                 slice of the tokens; around attention it holds every token for 1/sp of the heads, the same bytes)
    logits       the kept positions × vocabulary (`logits_bytes`): only response positions get logits when packed,
                 and each sequence-parallel rank those of its slice
    engine       its weights, KV cache and sampling/prefill workspace (while it is awake)

A phase holds what its roles need at once: the update holds the actor's whole training state and the activations of
one micro-batch; the rollout holds the engine and whatever trainer state is not offloaded to host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybridrl.training.host_optimizer import CHUNK_ELEMENTS

GiB = 2**30
PARTS = ("params", "grads", "optimizer", "activations", "logits", "engine", "others")
"""The columns of the estimate: this role's state, the pass's transients, the engine, other roles' resident state."""


@dataclass(frozen=True)
class ModelDims:
    """The dimensions of a decoder that decide its memory."""

    params: int
    layers: int
    hidden: int
    q_dim: int
    """Query width: heads × head_dim."""
    kv_dim: int
    """Key (= value) width: kv_heads × head_dim."""
    intermediate: int
    vocab: int
    tied: bool
    """Whether the output head shares the embedding."""
    vision: int = 0
    """Parameters of a vision-language model's vision tower and projector (included in `params`)."""

    @property
    def critic_params(self) -> int:
        """A value model of this body: the output head replaced by a scalar head."""
        return self.params - (0 if self.tied else self.vocab * self.hidden) + self.hidden + 1

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Keys and values of one token over all layers."""
        return 2 * self.layers * self.kv_dim * dtype_bytes


def activation_bytes_per_token(d: ModelDims, b: int, compiled: bool, checkpointing: bool) -> float:
    """Bytes autograd keeps per token for the backward, all layers.

    Eager (per layer): the rotated q and k, v, the attention output, gate, up, silu(gate) and their product in the
    compute dtype, and per RMSNorm the float32 copy of its input and its output before and after the weight (what
    torch's saved-tensor hooks report for a Qwen2 layer under sdpa; an attention kernel keeps q, k, v, its output and
    a float32 log-sum-exp per head, no [T, T] matrix).
    Compiled layers (torch.compile fuses the norms and silu·up and recomputes the cheap parts): the layer input and
    the attention block's output instead of the norm copies, and gate and up only. With gradient checkpointing each
    layer keeps its input, and the backward recomputes one layer at a time."""
    eager = b * (2 * d.q_dim + 2 * d.kv_dim + 4 * d.intermediate + 4 * d.hidden) + 8 * d.hidden
    fused = b * (2 * d.q_dim + 2 * d.kv_dim + 2 * d.intermediate + 2 * d.hidden)
    per_layer = fused if compiled else eager
    if checkpointing:
        return d.layers * b * d.hidden + per_layer
    return d.layers * per_layer


def nograd_bytes_per_token(d: ModelDims, b: int) -> float:
    """A no-grad forward's transient per token: one layer's intermediates at a time (q, k, v, attention out, gate,
    up, their product) and the residual stream."""
    return b * (3 * d.hidden + d.q_dim + 2 * d.kv_dim + 3 * d.intermediate)


def logits_path(chunk: int, fused: bool) -> str:
    """How the trainer turns hidden states into log-probs (`logits_bytes`' `path`): `trainer.logprob_chunk_size`
    (`chunk`) and whether the fused kernel runs (`fused`: GPU and `trainer.fused_logprobs`)."""
    if chunk:
        return "chunked_fused" if fused else "chunked"
    return "fused" if fused else "torch"


def logits_bytes(kept: float, vocab: int, b: int, path: str, with_grad: bool, chunk: int = 0) -> float:
    """Logits of `kept` positions: `path` fused (the Triton kernel reads the compute-dtype logits and writes their
    gradient over them: one buffer with or without the backward), torch (a float32 upcast and, for the entropy or
    the backward, a float32 softmax beside it), chunked (`chunk` positions' float32 logits at a time, nothing
    kept) or chunked_fused (one chunk's logits in the compute dtype through the fused kernel, on GPU); the chunked
    paths take the plain head's way when `kept` fits one chunk."""
    if path.startswith("chunked") and kept <= chunk:  # within one chunk the plain head runs (`logprobs.in_chunks`)
        path = {"chunked": "torch", "chunked_fused": "fused"}[path]
    if path == "chunked":
        return chunk * vocab * 4 * (3 if with_grad else 2)
    if path == "chunked_fused":
        return chunk * vocab * b
    if path == "fused":
        return kept * vocab * b
    return kept * vocab * (b + 8 + (4 if with_grad else 0))


@dataclass(frozen=True)
class EngineMemory:
    """The rollout engine while awake."""

    weights: float
    kv_cache: float
    workspace: float

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.workspace


@dataclass(frozen=True)
class MemoryInputs:
    """Everything the estimate reads (bytes per device)."""

    dims: ModelDims
    world: int
    compute_bytes: int
    update_tokens: int
    """Tokens of one update micro-batch (the budget, or rows × the longest sequence)."""
    logprob_tokens: int
    """Tokens of one log-prob micro-batch."""
    kept_fraction: float
    """Share of a micro-batch's positions that get logits (response tokens when packed, else all from the first
    response position on)."""
    engine: EngineMemory
    lora_params: int = 0
    """Adapter parameters (0 = full fine-tuning)."""
    frozen_params: int = 0
    """Parameters of a full fine-tuning that do not train (a frozen vision tower): float32 like the rest, without
    gradients or Adam moments."""
    checkpointing: bool = False
    compiled: bool = False
    logits_path: str = "fused"
    chunk: int = 0
    gathered_fraction: float = 1.0
    """Share of the model gathered at once by FSDP (1: one unit, the whole model)."""
    reshard_after_forward: bool = False
    """Units free their gathered parameters after each forward (`trainer.reshard_after_forward`)."""
    offload: frozenset[str] = field(default_factory=frozenset)
    """Actor parts in host memory during the rollout ("params", "optimizer")."""
    ref: bool = False
    ref_offload: bool = False
    critic: bool = False
    critic_offload: frozenset[str] = field(default_factory=frozenset)
    critic_tokens: int = 0
    engine_awake_in_training: bool = False
    """engine.sleep_level=0: the engine keeps its memory through the training phases."""
    sequence_parallel: int = 1
    """Ranks that split each micro-batch's tokens (`trainer.sequence_parallel_size`): the token counts above are
    the micro-batch's, each of these ranks computes its share."""
    optimizer_on_host: bool = False
    """The actor's Adam moments live in host memory and stream through the device for the step."""
    critic_optimizer_on_host: bool = False
    """The same for the critic's."""

    def with_(self, **changes) -> MemoryInputs:
        """A copy with some inputs changed (what-if estimates)."""
        return replace(self, **changes)


def trained_params(inp: MemoryInputs) -> int:
    """Parameters that get gradients and Adam moments: the adapters with LoRA, else all but the frozen ones."""
    return inp.lora_params or inp.dims.params - inp.frozen_params


def _state(inp: MemoryInputs, params: int, trained: int) -> tuple[float, float]:
    """(parameter bytes, optimizer bytes) a learner holds between passes: float32 masters of what trains, a frozen
    LoRA base in the compute dtype (another frozen part, float32 like the masters), Adam's moments."""
    frozen_bytes = inp.compute_bytes if inp.lora_params else 4
    return (4 * trained + frozen_bytes * (params - trained)) / inp.world, 8 * trained / inp.world


def reduce_bytes(unit_params: float, b: int, world: int) -> float:
    """Transient bytes of FSDP2's gradient reduction over a unit of `unit_params` parameters (its foreach_reduce):
    a float32 reduce-scatter input beside the unit's unsharded gradients while they are copied in, then beside the
    float32 output shard (a separate buffer even on one rank) before it is added to the accumulated gradient."""
    return unit_params * max(b + 4, 4 + 4 / world)


def streaming_slots(trained: int, world: int) -> float:
    """Device bytes of the host-moment step's slots of both float32 moments (`training/host_optimizer.py`): two
    of a chunk each, or one of the rank's trained elements when they fit one chunk."""
    per_rank = trained / world
    return (2 if per_rank > CHUNK_ELEMENTS else 1) * 2 * 4 * min(CHUNK_ELEMENTS, per_rank)


def host_bytes(inp: MemoryInputs) -> dict[str, float]:
    """Host memory per rank (pinned) outside the device estimate: Adam moments kept there, and what the offloads
    move there (the actor's and critic's parameters, their moments when they live on the device, the reference)."""
    d, w = inp.dims, inp.world
    trained = trained_params(inp)
    params, optim = _state(inp, d.params + inp.lora_params, trained)
    pc = d.critic_params
    out = {
        "actor_optimizer": optim if inp.optimizer_on_host or "optimizer" in inp.offload else 0.0,
        "actor_params": params if "params" in inp.offload else 0.0,
        "critic_optimizer": 8 * pc / w
        if inp.critic and (inp.critic_optimizer_on_host or "optimizer" in inp.critic_offload)
        else 0.0,
        "critic_params": 4 * pc / w if inp.critic and "params" in inp.critic_offload else 0.0,
        "ref_params": inp.compute_bytes * d.params / w if inp.ref and inp.ref_offload else 0.0,
    }
    return {k: v for k, v in out.items() if v}


def estimate_phases(inp: MemoryInputs) -> dict[str, dict[str, float]]:
    """Peak bytes per device of each phase, split by `PARTS`."""
    d, w, b = inp.dims, inp.world, inp.compute_bytes
    trained = trained_params(inp)
    params_all = d.params + inp.lora_params
    actor_params, actor_optim = _state(inp, params_all, trained)
    # Moments on the host: nothing of the optimizer on the device between steps, two streaming slots during one.
    actor_step = streaming_slots(trained, w) if inp.optimizer_on_host else actor_optim
    actor_optim = 0.0 if inp.optimizer_on_host else actor_optim
    # One rank with LoRA keeps the frozen base outside FSDP (`training/trainer.py`): only the adapters are gathered.
    gathered = b * (trained if inp.lora_params and w == 1 else params_all) * inp.gathered_fraction
    ref_params = b * d.params / w if inp.ref else 0.0
    pc = d.critic_params
    critic_params, critic_optim = (4 * pc / w, 8 * pc / w) if inp.critic else (0.0, 0.0)
    critic_step = streaming_slots(pc, w) if inp.critic and inp.critic_optimizer_on_host else critic_optim
    critic_optim = 0.0 if inp.critic_optimizer_on_host else critic_optim
    engine_in_training = inp.engine.total if inp.engine_awake_in_training else 0.0
    sp = inp.sequence_parallel  # each rank of an SP group computes 1/sp of a micro-batch's tokens
    kept_lp = inp.logprob_tokens * inp.kept_fraction / sp
    kept_up = inp.update_tokens * inp.kept_fraction / sp
    per_token = activation_bytes_per_token(d, b, inp.compiled, inp.checkpointing)
    activations = per_token * inp.update_tokens / sp
    # Unsharded gradients of the gathered units: a frozen part gathered with them (a vision tower, in the root) has
    # none; LoRA's adapters spread over the units like the parameters.
    gf = inp.gathered_fraction
    unsharded = trained * gf if inp.lora_params else params_all * gf - inp.frozen_params
    grads = 4 * trained / w + b * unsharded

    phases: dict[str, dict[str, float]] = {}
    resident = (0.0 if "params" in inp.offload else actor_params) + (0.0 if "optimizer" in inp.offload else actor_optim)
    others = (0.0 if inp.ref_offload else ref_params) + (
        (0.0 if "params" in inp.critic_offload else critic_params)
        + (0.0 if "optimizer" in inp.critic_offload else critic_optim)
    )
    phases["generate"] = {"params": resident, "engine": inp.engine.total, "others": others}
    # Log-probs: the actor's state (its Adam moments come back behind the pass), its gathered copy, and the
    # reference's copy beside it: the actor's stays gathered through the reference's pass unless its units reshard
    # after each forward, when one model's units are gathered at a time.
    ref_gathered = b * d.params * inp.gathered_fraction if inp.ref and not inp.reshard_after_forward else 0.0
    phases["logprob"] = {
        "params": actor_params + gathered,
        "optimizer": actor_optim,
        "activations": nograd_bytes_per_token(d, b) * inp.logprob_tokens / sp,
        "logits": logits_bytes(kept_lp, d.vocab, b, inp.logits_path, False, inp.chunk),
        "engine": engine_in_training,
        "others": ref_params + ref_gathered + critic_params,
    }
    others_update = (0.0 if inp.ref_offload else ref_params) + others_critic_after(inp, critic_params, critic_optim)
    backward = {
        "params": actor_params + gathered,
        "grads": grads,
        "optimizer": actor_step,
        "activations": activations,
        "logits": logits_bytes(kept_up, d.vocab, b, inp.logits_path, True, inp.chunk),
        "engine": engine_in_training,
        "others": others_update,
    }
    # The gradient reduction of each micro-batch: with one unit it runs after the whole backward (activations and
    # logits gone), with several while the earlier layers' backward still holds theirs.
    reduction = {
        "params": actor_params + gathered,
        "grads": 4 * trained / w + reduce_bytes(unsharded, b, w),
        "optimizer": actor_optim,
        "activations": activations if inp.gathered_fraction < 1 else 0.0,
        "engine": engine_in_training,
        "others": others_update,
    }
    phases["update"] = max(backward, reduction, key=lambda parts: sum(parts.values()))
    if inp.critic:
        gathered_c = b * pc * inp.gathered_fraction
        actor_resident = actor_params + actor_optim + ref_params
        phases["values"] = {
            "params": critic_params + gathered_c,
            "optimizer": critic_optim,
            "activations": nograd_bytes_per_token(d, b) * inp.critic_tokens / sp,
            "engine": engine_in_training,
            "others": actor_resident,
        }
        phases["update_critic"] = {
            "params": critic_params + gathered_c,
            "grads": 4 * pc / w + b * pc * inp.gathered_fraction,
            "optimizer": critic_step,
            "activations": per_token * inp.critic_tokens / sp,
            "engine": engine_in_training,
            "others": actor_resident,
        }
    return phases


def others_critic_after(inp: MemoryInputs, critic_params: float, critic_optim: float) -> float:
    """The critic's state during the actor's update: its copy to host memory starts right after its own update, so
    only what it does not offload stays."""
    return (0.0 if "params" in inp.critic_offload else critic_params) + (
        0.0 if "optimizer" in inp.critic_offload else critic_optim
    )


def peak(phases: dict[str, dict[str, float]]) -> tuple[str, float]:
    """The phase with the largest total, and that total."""
    name = max(phases, key=lambda p: sum(phases[p].values()))
    return name, sum(phases[name].values())
