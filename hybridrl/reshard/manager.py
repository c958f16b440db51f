"""The resharding manager: trainer weights → engine weights, gather → fuse → split → deliver, layer by layer.

Where it sits in one iteration (on every worker, all ranks together)::

    trainer.step()
    engine.wake_up(["weights"])
    stats = resharder.sync(trainer.model)     # for each layer: gather full → [merge LoRA] → fuse/split this
    engine.wake_up(["kv_cache"])              #   rank's shard → push whole fused groups in buckets of ≤ bucket_mb

A PEFT model (LoRA) is streamed under HF names with each adapted weight merged, W + (alpha/rank)·B·A, right after
its layer's gather: the engine receives effective weights, one layer's worth at a time.

Backends: ``copy`` hands each bucket to `engine.load_weights` in this process. ``broadcast`` sends the bucket's
full HF tensors from a source rank to the other ranks of a process group (one flat buffer), and each rank cuts
and delivers its own shard, so a trainer rank can feed engine ranks of another layout (or ranks with no model).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.models.vision import text_config
from hybridrl.reshard.broadcast import recv_bucket, send_bucket
from hybridrl.reshard.config import ReshardConfig
from hybridrl.reshard.gather import iter_full_layers
from hybridrl.reshard.layout import LayerGroup, TensorSpec, WeightLayout, build_layout
from hybridrl.reshard.lora_merge import LoraMerge
from hybridrl.reshard.reference import reference_shard
from hybridrl.reshard.stats import PeakTracker, PhaseClock, ReshardStats


class WeightSink(Protocol):
    """What the resharder delivers into: a rollout engine, or a plain tensor holder in tests and benchmarks."""

    weight_layout_style: str
    """The layout the sink holds ("hf" or "fused"; see reshard/layout.py)."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the given tensors into the sink, by name."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The sink's current tensors by name (for `reshard.verify`); may raise NotImplementedError."""


@dataclass
class _Bucket:
    """Specs waiting to be pushed, with their shards (copy) and/or their full sources (broadcast, verify)."""

    specs: list[TensorSpec] = field(default_factory=list)
    shards: list[torch.Tensor] = field(default_factory=list)
    sources: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0

    def tensors(self) -> list[torch.Tensor]:
        return [*self.shards, *self.sources.values()]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Resharder:
    """Moves a trainer model's weights into a rollout engine's layout, streamed one layer group at a time.

    `sync` must be called on every rank that holds a shard of the model (FSDP gathers are collectives), and
    with `model=None` on broadcast receivers that hold no trainer copy.
    """

    def __init__(
        self,
        config: ReshardConfig,
        engine: WeightSink | None,
        hf_config,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        style: str | None = None,
        group: dist.ProcessGroup | None = None,
        src: int | None = None,
        layout: WeightLayout | None = None,
        vision: bool = False,
    ) -> None:
        """`style` defaults to the engine's `weight_layout_style`; `group`/`src` (a global rank, default the
        group's lowest) are the broadcast backend's engine TP group and source; `layout` overrides the layout
        built from `hf_config` (tests inject broken ones); `vision`: a vision-language model's tower is delivered
        too (it trains), else it is left out of every sync (the engine loaded it and it does not change)."""
        self.config, self.engine, self.hf_config = config, engine, hf_config
        style = style or (engine.weight_layout_style if engine is not None else "hf")
        self.layout = layout or build_layout(hf_config, style, tp_rank, tp_size, vision=vision)
        self._specs = {s.name: s for s in self.layout.specs()}
        self._hf_shapes = self.layout.shape.hf_shapes()
        self._skip: set[str] = set()
        if any(g.name == "vision" for g in self.layout.groups):
            self._hf_shapes.update({s.name: s.shape for s in self.layout.group("vision").specs})
        else:
            self._skip.add("vision")
        self.backend = config.backend if config.backend != "auto" else ("broadcast" if group is not None else "copy")
        self.group, self.src, self.is_src = group, None, True
        self.device = torch.device("cpu")
        if self.backend == "broadcast":
            if group is None:
                raise ConfigError("reshard.backend=broadcast needs the engine TP process group")
            ranks = dist.get_process_group_ranks(group)
            self.src = ranks[0] if src is None else src
            if self.src not in ranks:
                raise ConfigError(f"reshard: broadcast source rank {self.src} is not in the group {ranks}")
            self.is_src = dist.get_rank() == self.src
            if dist.get_backend(group) == "nccl":
                self.device = torch.device("cuda", torch.cuda.current_device())
        elif engine is None:
            raise ConfigError("reshard.backend=copy needs an engine on this rank")
        self.bucket_bytes = config.bucket_mb * 2**20
        self.dtype = config.torch_dtype()

    # ---- public -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def sync(self, model: nn.Module | None) -> ReshardStats:
        """Push every weight of `model` into the engine; returns this rank's figures."""
        if model is None and (self.backend != "broadcast" or self.is_src):
            raise ConfigError("reshard: only broadcast receivers may sync without a model")
        stats = ReshardStats()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:  # peak stats are process-wide; reset so the delta belongs to this sync
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        self._stats, self._clock = stats, PhaseClock(stats, cuda)
        trainer = [] if model is None else [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        self._tracker = PeakTracker(exclude=trainer)
        self._delivered: set[str] = set()
        start = self._clock.now()
        if model is None:
            self._receive_all()
        else:
            self._stream(model)
        if self.config.verify and self.engine is not None:
            self._check_coverage()
        stats.total_s = self._clock.now() - start
        stats.peak_extra_bytes = self._tracker.peak
        if cuda:
            stats.cuda_peak_delta_bytes = torch.cuda.max_memory_allocated() - base
        return stats

    # ---- streaming ----------------------------------------------------------------------------------------

    def _stream(self, model: nn.Module) -> None:
        clock, tracker = self._clock, self._tracker
        keep_sources = self.backend == "broadcast" or self.config.verify
        bucket, seen = _Bucket(), []
        lora = LoraMerge.from_model(model)
        t = clock.now()
        stream = iter_full_layers(
            model, dtype=self.dtype, on_transient=tracker.observe, merge_lora=False, skip=self._skip
        )
        for name, full in stream:
            t = clock.add("gather_s", t)
            if lora is not None:
                full = self._merge(lora, full)
                t = clock.add("merge_s", t)
            group = self._check_group(name, full)
            seen.append(name)
            layer = dict(full)
            del full
            tracker.hold(layer.values())
            for unit in group.units():
                sources = {s: layer[s] for spec in unit for s in spec.sources}
                if self.backend == "copy":  # shard bytes, known from the layout before anything is built
                    nbytes = sum(spec.numel() * layer[spec.sources[0]].element_size() for spec in unit)
                else:  # source bytes: equal on every rank of the group, so all ranks flush together
                    nbytes = sum(_nbytes(x) for x in sources.values())
                if bucket.specs and bucket.nbytes + nbytes > self.bucket_bytes:
                    self._build_pending(bucket, layer)
                    self._flush(bucket)
                    bucket = _Bucket()
                bucket.specs += unit
                bucket.nbytes += nbytes
                if keep_sources:
                    tracker.hold(sources.values())
                    bucket.sources.update(sources)
            self._build_pending(bucket, layer)  # this layer's tensors go away next: cut what is left of it
            tracker.release(layer.values())
            layer = None
            t = clock.now()
        if bucket.specs:
            self._flush(bucket)
        missing = [g.name for g in self.layout.groups if g.name not in seen]
        if missing:
            raise HybridRLError(f"reshard: the model has no parameters for layout group(s) {missing}")
        if self.backend == "broadcast":
            if self.is_src:
                send_bucket(None, None, self.src, self.group, self.device)
            elif recv_bucket(self.src, self.group, self.device) is not None:
                raise HybridRLError("reshard: the broadcast source sent more buckets than this rank planned")

    def _merge(self, lora: LoraMerge, full: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """One gathered group with its LoRA factors merged into the weights (the gathered copies and the merged
        ones are alive together for a moment: counted as transient)."""
        merged = lora.merge(full)
        fresh = [t for (_, t) in merged if all(t is not g for _, g in full)]
        self._tracker.hold(t for _, t in full)
        self._tracker.observe(sum(_nbytes(t) for t in fresh))
        self._tracker.release(t for _, t in full)
        self._stats.lora_merged += len(fresh)
        return merged

    def _build_pending(self, bucket: _Bucket, layer: dict[str, torch.Tensor]) -> None:
        """Copy backend: cut the bucket's not yet built shards (all from `layer`), timed as one fuse/split step."""
        if self.backend != "copy" or len(bucket.shards) == len(bucket.specs):
            return
        t = self._clock.now()
        shards = [spec.build(layer) for spec in bucket.specs[len(bucket.shards) :]]
        self._clock.add("fuse_split_s", t)
        self._tracker.hold(shards)
        bucket.shards += shards

    def _flush(self, bucket: _Bucket) -> None:
        """Push one bucket: locally (copy), or broadcast it and let every rank cut its shards."""
        if self.backend == "copy":
            self._deliver(bucket.specs, bucket.shards, bucket.sources)
        else:
            names = [s.name for s in bucket.specs]
            t = self._clock.now()
            if self.is_src:
                sent = send_bucket(list(bucket.sources.items()), names, self.src, self.group, self.device)
                self._tracker.observe(sent)  # the flat send buffer
                self._stats.bytes_broadcast += sent
                self._clock.add("broadcast_s", t)
                if self.engine is not None:
                    self._build_and_deliver(bucket.specs, bucket.sources)
            else:
                got = recv_bucket(self.src, self.group, self.device)
                if got is None or got[1] != names:
                    raise HybridRLError(f"reshard: broadcast bucket differs from this rank's plan ({names[:3]}…)")
                sources, _, flat = got
                self._stats.bytes_broadcast += flat.numel()
                self._clock.add("broadcast_s", t)
                self._tracker.hold([flat])
                self._build_and_deliver(bucket.specs, sources)
                self._tracker.release([flat])
        self._tracker.release(bucket.tensors())

    def _receive_all(self) -> None:
        """A receiver without a model: take buckets until the source's end marker."""
        while True:
            t = self._clock.now()
            got = recv_bucket(self.src, self.group, self.device)
            if got is None:
                return
            sources, names, flat = got
            self._stats.bytes_broadcast += flat.numel()
            self._clock.add("broadcast_s", t)
            self._tracker.hold([flat])
            self._build_and_deliver([self._specs[n] for n in names], sources)
            self._tracker.release([flat])

    def _build_and_deliver(self, specs: list[TensorSpec], sources: dict[str, torch.Tensor]) -> None:
        t = self._clock.now()
        shards = [spec.build(sources) for spec in specs]
        self._clock.add("fuse_split_s", t)
        self._tracker.hold(shards)
        self._deliver(specs, shards, sources)
        self._tracker.release(shards)

    def _deliver(self, specs: list[TensorSpec], shards: list[torch.Tensor], sources: dict[str, torch.Tensor]) -> None:
        t = self._clock.now()
        self.engine.load_weights([(spec.name, shard) for spec, shard in zip(specs, shards)])
        self._clock.add("deliver_s", t)
        self._stats.bytes_moved += sum(_nbytes(s) for s in shards)
        self._stats.tensors += len(specs)
        self._stats.pushes += 1
        self._delivered.update(spec.name for spec in specs)
        if self.config.verify:
            self._verify(specs, sources)

    # ---- checks -------------------------------------------------------------------------------------------

    def _check_group(self, name: str, full: list[tuple[str, torch.Tensor]]) -> LayerGroup:
        """The layout group for a gathered group; every name and shape must match the layout exactly."""
        got = {n: tuple(t.shape) for n, t in full}
        try:
            group = self.layout.group(name)
        except KeyError:
            raise HybridRLError(
                f"reshard: model parameters {sorted(got)} have no place in the "
                f"{self.layout.style} layout of {self.layout.shape.model_type}"
            ) from None
        expected = set(group.sources())
        if set(got) != expected:
            raise HybridRLError(
                f"reshard: layer group {name}: model has {sorted(set(got) - expected)} the layout "
                f"does not know, lacks {sorted(expected - set(got))} (tie_word_embeddings or bias "
                f"settings differ from the config?)"
            )
        for n, shape in got.items():
            if shape != self._hf_shapes[n]:
                raise HybridRLError(f"reshard: {n} has shape {shape}, the config implies {self._hf_shapes[n]}")
        return group

    def _engine_weights(self) -> dict[str, torch.Tensor]:
        try:
            return dict(self.engine.named_weights())
        except NotImplementedError as e:
            raise HybridRLError(f"reshard.verify=true needs an engine that exposes named_weights(): {e}") from None

    def _verify(self, specs: list[TensorSpec], sources: dict[str, torch.Tensor]) -> None:
        """Compare what the engine now holds with `reference_shard` of the full sources; the first mismatch raises."""
        t = self._clock.now()
        held = self._engine_weights()
        for spec in specs:
            ref = reference_shard(
                text_config(self.hf_config),
                spec.name,
                sources,
                style=self.layout.style,
                tp_rank=self.layout.tp_rank,
                tp_size=self.layout.tp_size,
            )
            got = held.get(spec.name)
            if got is None:
                raise HybridRLError(f"reshard verify: the engine holds no tensor named {spec.name}")
            if got.shape != ref.shape:
                raise HybridRLError(
                    f"reshard verify: {spec.name} has shape {tuple(got.shape)} in the engine, "
                    f"the reference shard {tuple(ref.shape)}"
                )
            ref = ref.to(device=got.device, dtype=got.dtype)
            if not torch.equal(got, ref):
                diff = (got.double() - ref.double()).abs().max().item()
                raise HybridRLError(
                    f"reshard verify: {spec.name} differs from the reference shard (max abs diff {diff:.3g})"
                )
        self._clock.add("verify_s", t)

    def _check_coverage(self) -> None:
        """Every engine weight must have been written by this sync (engines do not check this themselves)."""
        stale = sorted(set(self._engine_weights()) - self._delivered)
        if stale:
            raise HybridRLError(f"reshard verify: {len(stale)} engine tensor(s) were not updated, e.g. {stale[:3]}")
