"""LoRA inside the resharder's stream: PEFT parameter names back to HF names, and `W + (alpha/rank)·B·A` per layer.

A PEFT-wrapped linear layer holds its frozen weight and its two factors under names of its own::

    [base_model.model.]model.layers.0.self_attn.q_proj.base_layer.weight    (out × in)  → ...q_proj.weight
    [base_model.model.]model.layers.0.self_attn.q_proj.lora_A.default.weight (r × in)
    [base_model.model.]model.layers.0.self_attn.q_proj.lora_B.default.weight (out × r)

The gather names every parameter with `hf_name` (factors keep their `lora_A.<adapter>` part) and gathers a layer
group; `LoraMerge.merge` then replaces each adapted weight of that group by its effective weight and drops the
factors, so one layer's merged tensors exist at a time (never a merged copy of the model). The merge runs in the
dtype the base weights were gathered in (`reshard.dtype`, else the trainer's: bfloat16 for a LoRA base on GPU),
with the factors cast to it.

No PEFT import: the adapted layers are found by what they hold (`lora_A`, `scaling`, `active_adapters`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from hybridrl.errors import HybridRLError

_WRAPPERS = re.compile(r"(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")  # compile/AC/FSDP1 prefixes
_PEFT_ROOT = "base_model.model."  # a PeftModel's path to the wrapped HF model
_FACTOR = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight")

NamedTensors = list[tuple[str, torch.Tensor]]


def hf_name(raw: str) -> str:
    """A parameter's HF name: wrapper prefixes, a PeftModel's root and PEFT's `base_layer.` removed. LoRA factors
    keep their `lora_A.<adapter>` / `lora_B.<adapter>` part (`is_factor` recognizes them)."""
    name = _WRAPPERS.sub("", raw).removeprefix(_PEFT_ROOT)
    return name.replace(".base_layer.", ".")


def is_factor(name: str) -> bool:
    """Whether an `hf_name` is a LoRA factor (merged away before the layout sees the group)."""
    return _FACTOR.fullmatch(name) is not None


@dataclass(frozen=True)
class LoraMerge:
    """The scale of every active adapter of a model, by (HF module name, adapter name), read from PEFT's layers."""

    scales: dict[tuple[str, str], float]

    @classmethod
    def from_model(cls, model: nn.Module) -> LoraMerge | None:
        """The model's adapters, or None when it has no LoRA layer. Layers whose adapters are switched off or
        already merged into the base contribute nothing (their effective weight is the base weight)."""
        scales: dict[tuple[str, str], float] = {}
        found = False
        for raw, module in model.named_modules():
            if not (hasattr(module, "lora_A") and isinstance(getattr(module, "scaling", None), dict)):
                continue
            found = True
            name = hf_name(raw)
            if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
                continue
            for adapter in module.active_adapters:
                if adapter not in module.lora_A:
                    continue
                _check_plain_lora(name, module, adapter)
                scales[(name, adapter)] = float(module.scaling[adapter])
        if not found:
            return None
        return cls(scales)

    def merge(self, named: Iterable[tuple[str, torch.Tensor]]) -> NamedTensors:
        """The group's tensors with every adapted `<module>.weight` replaced by W + scale·B·A and the factors
        removed. New tensors only: W may be a view of the trainer's own parameter."""
        plain: NamedTensors = []
        factors: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for name, t in named:
            m = _FACTOR.fullmatch(name)
            if m is None:
                if ".lora_" in name:
                    raise HybridRLError(
                        f"reshard: cannot merge {name}: only LoRA on linear layers (lora_A/lora_B) is supported"
                    )
                plain.append((name, t))
            else:
                factors.setdefault((m["module"], m["adapter"]), {})[m["ab"]] = t
        index = {name: i for i, (name, _) in enumerate(plain)}
        for (module, adapter), ab in factors.items():
            scale = self.scales.get((module, adapter))
            if scale is None:  # an inactive adapter, or the layer's adapters are off / already merged
                continue
            if set(ab) != {"A", "B"}:
                missing = "".join(sorted({"A", "B"} - set(ab)))
                raise HybridRLError(
                    f"reshard: LoRA layer {module} ({adapter}) lacks its lora_{missing} factor in this group"
                )
            i = index.get(f"{module}.weight")
            if i is None:
                raise HybridRLError(f"reshard: LoRA factors of {module} have no base weight {module}.weight")
            plain[i] = (plain[i][0], merged_weight(plain[i][1], ab["A"], ab["B"], scale))
        return plain


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale·(B @ A) as a new tensor of W's dtype: one addmm in W's dtype, the (small) factors cast to it.

    A bfloat16 W is read and written once (no float32 copy of the layer); the matmul accumulates in float32 and the
    sum is rounded once, and bfloat16 factors are what the trainer's forward computes with anyway."""
    return torch.addmm(w, b.to(w.dtype), a.to(w.dtype), alpha=scale)


def _check_plain_lora(name: str, module: nn.Module, adapter: str) -> None:
    """Only the variant the trainer configures (plain LoRA on nn.Linear) has the merge above."""
    for flag in ("use_dora", "lora_bias"):
        if getattr(module, flag, {}).get(adapter, False):
            raise HybridRLError(f"reshard: {name} uses {flag} ({adapter}); only plain LoRA adapters can be merged")
    if getattr(module, "fan_in_fan_out", False):
        raise HybridRLError(f"reshard: {name} stores its weight transposed (fan_in_fan_out); not supported")
