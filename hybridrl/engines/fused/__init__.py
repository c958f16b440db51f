"""The native engine's fused decoder (llama/qwen2/qwen3): model, paged KV cache, CUDA-graphed decode, TP view."""

from hybridrl.engines.fused.groups import TensorParallel
from hybridrl.engines.fused.rope import UnsupportedModel, check_supported

__all__ = ["TensorParallel", "UnsupportedModel", "check_supported"]
