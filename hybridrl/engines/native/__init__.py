"""The native engine: our decoder for llama/qwen2/qwen3 (fused weights, paged KV cache, continuous batching, CUDA
graphs, tensor parallel) and the transformers path for every other architecture.

- `engine.FusedEngine`, `model`, `scheduler`, `prompts`, `runner`, `cuda_graphs`, `step_io`, `blocks`, `kv_cache`:
  the fused decoder and its step loop;
- `hf.HFEngine`: transformers' `generate` for architectures the fused decoder does not cover;
- `async_engine.AsyncEngine`: many coroutines (agent turns) sharing one continuously batched engine;
- `fixed_memory`, `frozen_heap`, `weight_offload`: device memory across sleep and wake-up;
- `kernels/`: the Triton kernels of the decode step and the sampler, each beside its torch reference.
"""

from hybridrl.engines.native.architectures import UnsupportedModel, check_supported
from hybridrl.engines.native.tensor_parallel import TensorParallel

__all__ = ["TensorParallel", "UnsupportedModel", "check_supported"]
