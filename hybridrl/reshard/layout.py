"""Weight layouts: which engine tensors exist, which HF tensors feed each, and how one TP rank's shard is cut.

Two styles (`RolloutEngine.weight_layout_style`):

- ``"hf"``: engine names are HF names and tensors are full; the engine (vLLM, SGLang) fuses and splits itself.
- ``"fused"``: vLLM's parameter layout, already cut for one tensor-parallel rank: ``qkv_proj`` (GQA-aware),
  ``gate_up_proj``, row-parallel ``o_proj``/``down_proj``, vocab-parallel embeddings padded to 64 rows.

A caller streams a model one layer group at a time::

    layout = build_layout(hf_config, "fused", tp_rank, tp_size)
    for group_name, full in iter_full_layers(model):          # {"embed", "layers.0", ..., "final"}
        for unit in layout.group(group_name).units():         # specs pushed together (one engine module)
            shards = [(s.name, s.build(dict(full))) for s in unit]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hybridrl.errors import ConfigError
from hybridrl.models.shape import ModelShape, padded_vocab

STYLES = ("hf", "fused")


@dataclass(frozen=True)
class Piece:
    """This rank's slice of one source tensor: `length` entries from `start` along `dim`, zero-padded to `pad_to`."""

    source: str
    dim: int | None = None  # None: the whole tensor
    start: int = 0
    length: int = 0
    pad_to: int | None = None

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """Cut the slice; a view unless padding forces a copy."""
        if self.dim is None:
            return full
        part = full.narrow(self.dim, self.start, self.length)
        if self.pad_to is None or self.pad_to == self.length:
            return part
        shape = list(full.shape)
        shape[self.dim] = self.pad_to
        out = full.new_zeros(shape)
        out.narrow(self.dim, 0, self.length).copy_(part)
        return out


@dataclass(frozen=True)
class TensorSpec:
    """One engine tensor on this rank: its name, the HF tensors it is fused from and how to cut its shard."""

    name: str
    """Engine parameter name."""
    sources: tuple[str, ...]
    """HF names, in fuse order."""
    fuse_dim: int | None
    """Dimension along which the sources are concatenated; None for a single source."""
    tp_dim: int | None
    """Dimension split across TP ranks; None when replicated (or in the hf style)."""
    unit: str
    """The engine module this tensor belongs to; a push never splits a unit (vLLM corrupts partial qkv pushes)."""
    shape: tuple[int, ...]
    """Shape of this rank's shard."""
    pieces: tuple[Piece, ...]
    """This rank's slice of each source, in fuse order."""

    def build(self, full: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This rank's shard from the full source tensors: slice each source, then concatenate (one copy)."""
        parts = [p.take(full[p.source]) for p in self.pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.fuse_dim)

    def numel(self) -> int:
        """Elements in this rank's shard."""
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class LayerGroup:
    """The specs of one streaming step: ``embed``, ``layers.{i}`` or ``final``."""

    name: str
    specs: tuple[TensorSpec, ...]

    def sources(self) -> list[str]:
        """HF names this group reads."""
        return [s for spec in self.specs for s in spec.sources]

    def units(self) -> list[tuple[TensorSpec, ...]]:
        """Specs grouped by engine module, in order; each unit is delivered whole."""
        units: dict[str, list[TensorSpec]] = {}
        for spec in self.specs:
            units.setdefault(spec.unit, []).append(spec)
        return [tuple(u) for u in units.values()]


@dataclass(frozen=True)
class WeightLayout:
    """Every engine tensor for one (style, tp_rank, tp_size), grouped by layer in streaming order."""

    style: str
    tp_rank: int
    tp_size: int
    shape: ModelShape
    groups: tuple[LayerGroup, ...]

    def group(self, name: str) -> LayerGroup:
        """The group called `name` (KeyError if absent)."""
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def specs(self) -> list[TensorSpec]:
        """All specs in streaming order."""
        return [s for g in self.groups for s in g.specs]

    def spec(self, name: str) -> TensorSpec:
        """The spec of engine tensor `name` (KeyError if absent)."""
        for s in self.specs():
            if s.name == name:
                return s
        raise KeyError(name)


def build_layout(
    config, style: str = "fused", tp_rank: int = 0, tp_size: int = 1, vision: bool = False
) -> WeightLayout:
    """The weight layout of an HF config's model for one engine style and TP rank. Of a vision-language model: its
    language model's, under the decoder's checkpoint names, and with `vision` (a tower that trains) a first group
    ``vision`` of the tower's tensors, whole on every rank (`hybridrl.models.vision`)."""
    if style not in STYLES:
        raise ConfigError(f"reshard: unknown weight layout style {style!r}; expected one of {STYLES}")
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"reshard: tp_rank {tp_rank} is outside [0, tp_size={tp_size})")
    shape = ModelShape.from_hf_config(config)
    tower = _vision_group(config) if vision else ()
    if style == "hf":
        return WeightLayout(style, tp_rank, tp_size, shape, (*tower, *_hf_groups(shape)))
    _check_tp(shape, tp_size)
    return WeightLayout(style, tp_rank, tp_size, shape, (*tower, *_fused_groups(shape, tp_rank, tp_size)))


def _vision_group(config) -> tuple[LayerGroup, ...]:
    """The vision tower's tensors as one group, each whole (the tower is small and no engine shards it by our cut)."""
    from hybridrl.models.vision import is_vision_language, vision_shapes

    if not is_vision_language(config):
        raise ConfigError(f"reshard: model_type {config.model_type!r} has no vision tower to deliver")
    specs = tuple(
        TensorSpec(name, (name,), None, None, _unit_of(name), shape, (Piece(name),))
        for name, shape in vision_shapes(config).items()
    )
    return (LayerGroup("vision", specs),)


def _check_tp(shape: ModelShape, tp: int) -> None:
    """The divisibility rules vLLM asserts, as a ConfigError up front."""
    if shape.heads % tp:
        raise ConfigError(f"engine.tp_size={tp} must divide num_attention_heads={shape.heads}")
    if shape.kv_heads % tp and tp % shape.kv_heads:
        raise ConfigError(f"engine.tp_size={tp} and num_key_value_heads={shape.kv_heads}: one must divide the other")
    if shape.intermediate % tp:
        raise ConfigError(f"engine.tp_size={tp} must divide intermediate_size={shape.intermediate}")
    if padded_vocab(shape.vocab) % tp:
        raise ConfigError(f"engine.tp_size={tp} must divide the padded vocab {padded_vocab(shape.vocab)}")


def _group_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        return "layers." + hf_name.split(".")[2]
    return "embed" if "embed_tokens" in hf_name else "final"


def _unit_of(hf_name: str) -> str:
    """The engine module an HF tensor ends up in: q/k/v → qkv_proj, gate/up → gate_up_proj."""
    module = hf_name.rsplit(".", 1)[0]
    for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
        head, _, last = module.rpartition(".")
        if last in parts:
            return f"{head}.{fused}"
    return module


def _hf_groups(shape: ModelShape) -> tuple[LayerGroup, ...]:
    groups: dict[str, list[TensorSpec]] = {}
    for name, full_shape in shape.hf_shapes().items():
        spec = TensorSpec(name, (name,), None, None, _unit_of(name), full_shape, (Piece(name),))
        groups.setdefault(_group_name(name), []).append(spec)
    return tuple(LayerGroup(n, tuple(s)) for n, s in groups.items())


def _fused_groups(shape: ModelShape, r: int, tp: int) -> tuple[LayerGroup, ...]:
    h, d, hf = shape.hidden, shape.head_dim, shape.hf_shapes()

    def replicated(name: str) -> TensorSpec:
        return TensorSpec(name, (name,), None, None, name.rsplit(".", 1)[0], hf[name], (Piece(name),))

    def vocab_parallel(name: str) -> TensorSpec:
        rows = padded_vocab(shape.vocab) // tp
        start = r * rows
        real = max(0, min(shape.vocab - start, rows))  # padding rows past the real vocab are zero
        piece = Piece(name, 0, min(start, shape.vocab), real, rows)
        return TensorSpec(name, (name,), None, 0, name.rsplit(".", 1)[0], (rows, h), (piece,))

    def row_parallel(name: str) -> TensorSpec:  # split the input dim (columns)
        out_dim, in_dim = hf[name]
        cols = in_dim // tp
        piece = Piece(name, 1, r * cols, cols)
        return TensorSpec(name, (name,), None, 1, name.rsplit(".", 1)[0], (out_dim, cols), (piece,))

    embed = LayerGroup("embed", (vocab_parallel("model.embed_tokens.weight"),))
    layers = []
    # GQA as vLLM's QKVParallelLinear: with tp > kv_heads, each rank holds kv head r // (tp / kv_heads).
    q_per = shape.heads // tp
    kv_per = max(1, shape.kv_heads // tp)
    kv_first = r * kv_per if tp <= shape.kv_heads else r // (tp // shape.kv_heads)
    inter = shape.intermediate // tp
    for i in range(shape.num_layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        specs: list[TensorSpec] = []
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            src = tuple(f"{a}.{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj"))
            pieces = (
                Piece(src[0], 0, r * q_per * d, q_per * d),
                Piece(src[1], 0, kv_first * d, kv_per * d),
                Piece(src[2], 0, kv_first * d, kv_per * d),
            )
            rows = (q_per + 2 * kv_per) * d
            shard_shape = (rows, h)[: len(hf[src[0]])]  # a bias has no input dim
            specs.append(TensorSpec(f"{a}.qkv_proj.{kind}", src, 0, 0, f"{a}.qkv_proj", shard_shape, pieces))
        specs.append(row_parallel(f"{a}.o_proj.weight"))
        if shape.o_bias:
            specs.append(replicated(f"{a}.o_proj.bias"))  # added once after the all-reduce; every rank holds it whole
        if shape.qk_norm:
            specs += [replicated(f"{a}.q_norm.weight"), replicated(f"{a}.k_norm.weight")]  # per head: replicated
        for kind in ("weight", "bias") if shape.mlp_bias else ("weight",):
            src = (f"{m}.gate_proj.{kind}", f"{m}.up_proj.{kind}")
            pieces = tuple(Piece(s, 0, r * inter, inter) for s in src)
            shard_shape = (2 * inter, h)[: len(hf[src[0]])]
            specs.append(TensorSpec(f"{m}.gate_up_proj.{kind}", src, 0, 0, f"{m}.gate_up_proj", shard_shape, pieces))
        specs.append(row_parallel(f"{m}.down_proj.weight"))
        if shape.mlp_bias:
            specs.append(replicated(f"{m}.down_proj.bias"))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            specs.append(replicated(f"model.layers.{i}.{norm}.weight"))
        layers.append(LayerGroup(f"layers.{i}", tuple(specs)))
    final = [replicated("model.norm.weight")]
    if not shape.tied:  # tied: the engine's lm_head is its embed_tokens, already sent
        final.append(vocab_parallel("lm_head.weight"))
    return (embed, *layers, LayerGroup("final", tuple(final)))
