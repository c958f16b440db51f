"""Resharding: trainer (FSDP2) weights → rollout engine layout; gather → fuse → split → deliver, by layer."""

from hybridrl.models.shape import ModelShape
from hybridrl.reshard.config import ReshardConfig
from hybridrl.reshard.gather import iter_full_layers
from hybridrl.reshard.layout import TensorSpec, WeightLayout, build_layout
from hybridrl.reshard.manager import Resharder
from hybridrl.reshard.reference import reference_shard
from hybridrl.reshard.stats import ReshardStats

__all__ = [
    "ModelShape",
    "ReshardConfig",
    "ReshardStats",
    "Resharder",
    "TensorSpec",
    "WeightLayout",
    "build_layout",
    "iter_full_layers",
    "reference_shard",
]
