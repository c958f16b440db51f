"""Benchmarks of the product, each built through the run's own builder and phases; each prints one JSON object.

    python -m benchmarks.engine     rollout throughput of the run's engine (single, GRPO-shaped, multi-turn)
    python -m benchmarks.step       a full RL step through the controller, phase by phase
    python -m benchmarks.trainer    the actor's update against plain FSDP2
    python -m benchmarks.lifecycle  sleep / wake / offload / onload / reshard seconds and memory freed
    python -m benchmarks.lora       LoRA against full fine-tuning: peak memory, step time, reshard with the merge
    python -m benchmarks.reshard    the reshard phase against a plain state_dict copy, on one or several devices
    python -m benchmarks.kernels    launch sweeps of the native engine's Triton decode kernels (GPU only)
    python -m benchmarks.partial_demo   the CPU demo's learning, synchronous against rollout=partial, on several seeds

`--help` on each says what it measures and what its JSON holds; `benchmarks/gpu.sh` runs them on a GPU by group.
"""
