"""Weight delivery into the in-process vLLM `LLM`: HF-named full tensors, whole fused modules at a time.

- On CPU vLLM repacks linear weights for oneDNN and leaves `(0,)`-shaped parameters, so a direct
  `model.load_weights` fails; `collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_format=True)`
  works (layerwise reload: a module is rebuilt when all its tensors have arrived, modules not in the push keep
  their old weights, a module that gets only part of its tensors is corrupted — hence `check_whole_modules`).
  A tied lm_head keeps a packed copy of embed_tokens that the reload does not refresh: without
  `repack_tied_lm_head` a pushed embedding changes the inputs but not the logits.
- On GPU `load_in_place` calls `model.load_weights` in-process (copies into the existing storage, so the CUDA
  graphs keep their addresses). Both paths are followed by `reset_prefix_cache()`.
- TP=2 on CPU: both ranks receive full tensors and vLLM splits them; both return identical samples afterwards.
- Harmless noise on every CPU push: "RotaryEmbedding/ParallelLMHead: Failed to load weights" (modules with
  nothing to load keep their tensors; the tied head is re-packed).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

#: HF module -> the vLLM module it is fused into.
FUSED_MODULES = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def module_key(name: str) -> str:
    """The vLLM module an HF tensor lands in: `...self_attn.k_proj.bias` -> `...self_attn.qkv_proj`."""
    module, _, _ = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{FUSED_MODULES.get(leaf, leaf)}"


def checkpoint_modules(path: Path) -> dict[str, set[str]] | None:
    """vLLM module -> the HF tensor names the checkpoint holds for it (read from safetensors headers)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    modules: dict[str, set[str]] = defaultdict(set)
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                modules[module_key(name)].add(name)
    return dict(modules)


def check_whole_modules(names: Iterable[str], modules: dict[str, set[str]] | None) -> None:
    """Refuse a push that gives a fused vLLM module only part of its tensors (vLLM would corrupt the rest).
    `modules`: what the checkpoint holds per module (`checkpoint_modules`); None skips the check."""
    if modules is None:
        return
    pushed = defaultdict(set)
    for name in names:
        pushed[module_key(name)].add(name)
    for key, got in pushed.items():
        want = modules.get(key)
        if want is not None and not want <= got:
            raise ValueError(
                f"partial weight push for vLLM module {key}: got {sorted(got)}, missing {sorted(want - got)}. "
                "Send every tensor of a fused module in one load_weights call (q/k/v with their biases, "
                "gate/up); vLLM rebuilds a module from whatever arrived and would corrupt the rest."
            )


def load_in_place(worker, weights) -> None:
    """Runs inside vLLM's worker (in-process): the direct loader, which copies into the existing storage."""
    worker.model_runner.model.load_weights(weights)


def repack_tied_lm_head(worker) -> None:
    """CPU: a tied lm_head shares embed_tokens' weight but keeps its own oneDNN-packed copy, made at load time;
    reloading embed_tokens does not refresh it (the logits would still use the old weights). Re-pack it."""
    head = getattr(worker.model_runner.get_model(), "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)
