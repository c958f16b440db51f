"""Helpers of the SGLang rollout engine (`hybridrl.engines.sglang.engine`).

- `payload`: HF-named tensors → one serialized `flattened_bucket` payload per TP rank.
- `tp`: the engine TP group's CPU process group and the leader-centred collectives.
- `requests`: our SamplingParams → SGLang request dicts, and SGLang outputs → Completions.

Nothing here imports `sglang` at module level: it is a CUDA-only install.
"""
