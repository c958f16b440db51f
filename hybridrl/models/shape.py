"""The decoder dimensions both the resharder and the fused engine read (a re-export until the lead's move lands)."""

from hybridrl.reshard.layout import SUPPORTED_MODEL_TYPES, ModelShape, padded_vocab

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelShape", "padded_vocab"]
