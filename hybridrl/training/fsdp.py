"""Turning a Hugging Face model into an FSDP2 one: precision policy, compiled layers, sharding units.

Every FSDP role (the actor, the reference, a critic) is built the same way::

    precision = Precision.for_device(cfg.param_dtype, device)
    model = load_causal_lm(path, model_cfg, torch.float32, device)      # float32 masters (frozen: compute dtype)
    if use_compile(cfg.compile, model_cfg.gradient_checkpointing, device):
        compile_layers(model)
    model = shard_model(model, topology.fsdp_mesh(device.type), precision.policy,
                        cfg.fsdp_layers_per_unit, cfg.reshard_after_forward)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Precision:
    """How an FSDP role stores and computes: float32 master weights, computed in `compute_dtype`."""

    compute_dtype: torch.dtype
    """What forward and backward run in (bfloat16 on GPU by default, float32 on CPU)."""

    @classmethod
    def for_device(cls, param_dtype: str, device: torch.device) -> Precision:
        """`trainer.param_dtype` resolved: auto is bfloat16 on GPU and float32 on CPU."""
        name = param_dtype if param_dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
        return cls(getattr(torch, name))

    @property
    def policy(self) -> MixedPrecisionPolicy | None:
        """FSDP's mixed-precision policy (gradients reduced in float32), or None when computing in float32."""
        if self.compute_dtype == torch.float32:
            return None
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)

    @property
    def frozen_dtype(self) -> torch.dtype:
        """Storage of a frozen model: no float32 master copy is needed, FSDP would cast to this anyway."""
        return self.compute_dtype


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of an HF model (`model.model.layers`, or `model.layers` on a bare decoder; a
    vision-language model's language model's, `model.model.language_model.layers`)."""
    inner = getattr(model, "model", model)
    inner = getattr(inner, "language_model", inner)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise NotImplementedError(f"cannot find decoder layers in {type(model).__name__} (expected model.model.layers)")
    return list(layers)


#: Models up to this many parameters shard as one unit by default (their gathered copy is small next to the device,
#: and per-layer hooks made the update CPU-bound on the H200). Larger ones are cut into units of 4 layers, on one rank
#: too: a single unit reduces the whole model's gradients at once, a float32 copy and a float32 output beside their
#: bf16 form and the float32 gradients (85 GiB of gradient memory at 7B, where the 7B step on one H200 ran out).
ONE_UNIT_PARAMS = 2_000_000_000


def unit_layout(
    num_layers: int, num_params: int, layers_per_unit: int = 0, reshard_after_forward: bool | None = None
) -> tuple[int, bool]:
    """(decoder layers per FSDP unit, whether to reshard after forward) for `trainer.fsdp_layers_per_unit` and
    `trainer.reshard_after_forward` (0 / None = auto); a unit of `num_layers` means the root is the only unit.
    `num_params` counts what FSDP manages (not a frozen base it ignores)."""
    if layers_per_unit:
        per_unit = min(layers_per_unit, num_layers)
    else:
        per_unit = num_layers if num_params <= ONE_UNIT_PARAMS else 4
    if reshard_after_forward is None:
        reshard_after_forward = per_unit < num_layers and num_params > ONE_UNIT_PARAMS
    return per_unit, reshard_after_forward


def shard_model(
    model: torch.nn.Module,
    mesh,
    mp: MixedPrecisionPolicy | None,
    layers_per_unit: int = 0,
    reshard_after_forward: bool | None = None,
    ignored_params: set[torch.nn.Parameter] | None = None,
) -> torch.nn.Module:
    """fully_shard groups of decoder layers (`unit_layout`), then the root (embeddings, final norm, heads).

    Layer units bound memory (one unit gathered and one unit's gradients reduced at a time) and overlap its
    all-gather with compute; each unit costs hooks on the CPU at every forward and backward, and a collective each.
    Up to `ONE_UNIT_PARAMS` the root is the only unit: one gather-and-cast per forward and one gradient reduction per
    backward (on the H200 the per-unit hooks took about a fifth of a 1.5B update's CPU time, and the update was
    CPU-bound). Parameters stay DTensors with mixed precision either way. `ignored_params` stay
    plain tensors outside FSDP (a frozen LoRA base on one rank: FSDP would otherwise hold it twice, sharded and
    unsharded, with nothing to shard).
    """
    layers = decoder_layers(model)
    n_params = sum(p.numel() for p in model.parameters() if p not in (ignored_params or ()))
    per_unit, reshard = unit_layout(len(layers), n_params, layers_per_unit, reshard_after_forward)
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard}
    if ignored_params:
        kwargs["ignored_params"] = ignored_params
    if mp is not None:
        kwargs["mp_policy"] = mp
    if per_unit < len(layers):
        for start in range(0, len(layers), per_unit):
            group = layers[start : start + per_unit]
            fully_shard(group if len(group) > 1 else group[0], **kwargs)
    fully_shard(model, **kwargs)
    return model


def reshard_units(root: torch.nn.Module) -> None:
    """Every FSDP unit under `root` back to sharded storage (frees gathered copies kept after a forward)."""
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


#: Graphs dynamo may compile per code object of the trainer's layers: roles (actor, reference, critic) × gradients on
#: or off × static and dynamic sizes is 12; the margin covers graph breaks' resume functions, which count alike.
RECOMPILE_LIMIT = 64


def compile_layers(model: torch.nn.Module) -> None:
    """torch.compile the forward of every decoder layer (before FSDP wraps them).

    Only the layer's own computation is compiled: FSDP2's gather/free hooks run around it in eager mode.
    All layers share one code object, so they share the compiled graphs (parameters are graph inputs).
    If compiling fails on this machine (no compiler, an unsupported op), PyTorch warns and runs eagerly.

    The actor's, the reference's and the critic's layers share that code object too, and dynamo keys a graph on
    whether gradients are on (log-prob passes against the update) and whether the parameters require them (a frozen
    reference): with the static and the dynamic-size graph of each, a GRPO run with a reference reaches dynamo's
    default of 8 graphs per code object, past which the variants left run uncompiled. The limit is raised to
    `RECOMPILE_LIMIT` so that every variant a run makes compiles once.
    """
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=None)


def use_compile(requested: bool, gradient_checkpointing: bool, device: torch.device) -> bool:
    """Whether to compile the layers: on GPU when asked, and not together with gradient checkpointing."""
    if not (requested and device.type == "cuda"):
        return False
    if gradient_checkpointing:
        log.info("trainer.compile is not applied with model.gradient_checkpointing (not tested together)")
        return False
    return True
