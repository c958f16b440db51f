"""Attention over packed sequences: one variable-length call that never lets a token see another sequence.

A packed forward feeds the model one row of several sequences laid end to end (`training/packing.py`) with
`position_ids` restarting at 0 at each sequence and the boundaries as `cu_seq_lens_q/k` (cumulative lengths, the
FlashAttention convention transformers' `FlashAttentionKwargs` use). How the attention keeps sequences apart is
`trainer.packed_attention`::

    varlen  this module's attention function, registered with transformers as VARLEN: on a GPU in bf16/fp16, torch's
            FlashAttention varlen kernel (`torch.nn.attention.varlen.varlen_attn`: no [T, T] mask, work Σ len²);
            elsewhere one causal `scaled_dot_product_attention` per sequence (exact on CPU, float32 included)
    model   `model.attn_implementation` as transformers runs it on packed position_ids: flash_attention_2 reads the
            cu_seqlens (varlen); sdpa and eager get a block-diagonal causal mask built from the restarts, a [T, T]
            tensor per micro-batch (fine on CPU, O(T²) memory and compute on a GPU)
    auto    varlen when the model's implementation is sdpa; the model's own otherwise (flash_attention_2 is already
            varlen, eager is an explicit request for the reference math)

The function takes a padded batch too (a 2D attention mask, no cu_seqlens): causal sdpa with the padding mask.
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F

from hybridrl.errors import ConfigError

log = logging.getLogger(__name__)

#: The name the varlen attention is registered under in transformers' AttentionInterface.
VARLEN = "hybridrl_varlen"
PACKED_ATTENTION = ("auto", "varlen", "model")

try:  # torch >= 2.9 ships FlashAttention's varlen kernel for CUDA
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - depends on the torch build
    _varlen_attn = None

# The kernel's keyword arguments moved between torch releases (is_causal → window_size; enable_gqa added).
_VARLEN_PARAMS = set(inspect.signature(_varlen_attn).parameters) if _varlen_attn is not None else set()


def kernel_available(query: torch.Tensor) -> bool:
    """Whether torch's FlashAttention varlen kernel can take `query` (CUDA, half precision)."""
    return _varlen_attn is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)


def _kernel(q, k, v, cu: torch.Tensor, max_len: int, scale: float | None) -> torch.Tensor:
    """FlashAttention varlen over [T, H, D] tensors, causal within each sequence."""
    kw: dict = {}
    if "window_size" in _VARLEN_PARAMS:
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    if scale is not None and "scale" in _VARLEN_PARAMS:
        kw["scale"] = scale
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kw["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu = cu.to(torch.int32)
    return _varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


@torch.compiler.disable  # host-side grouping by length: compiled layers call it eagerly, never recompile for it
def _per_sequence(q, k, v, cu: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal attention of each sequence alone, over [H, T, D] tensors: sequences of similar length (the same power
    of two) are gathered into one padded batch for one sdpa call each, so a few calls cover a micro-batch and no
    sequence sees another (nor does its result depend on another's tokens)."""
    bounds = cu.tolist()
    starts, lengths = bounds[:-1], [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    classes: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n:
            classes.setdefault((n - 1).bit_length(), []).append(i)
    flats, outs = [], []
    for members in classes.values():
        width = max(lengths[i] for i in members)
        # (sequence, position) of every real token of the class, and its place in the packed row
        seq = torch.cat([torch.full((lengths[i],), j) for j, i in enumerate(members)])
        pos = torch.cat([torch.arange(lengths[i]) for i in members])
        flat = torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in members])
        seq, pos, flat = seq.to(q.device), pos.to(q.device), flat.to(q.device)

        def batch(x: torch.Tensor) -> torch.Tensor:  # [H, T, D] -> [n, H, width, D], zeros past each end
            padded = x.new_zeros(len(members), width, x.shape[0], x.shape[2])
            return padded.index_put((seq, pos), x[:, flat].transpose(0, 1)).transpose(1, 2)

        idx = torch.arange(width, device=q.device)
        real = idx[None, :] < torch.tensor([lengths[i] for i in members], device=q.device)[:, None]
        mask = (idx[:, None] >= idx[None, :])[None, None] & real[:, None, None, :]
        o = F.scaled_dot_product_attention(
            batch(q), batch(k), batch(v), attn_mask=mask, scale=scale, enable_gqa=k.shape[0] != q.shape[0]
        )
        flats.append(flat)
        outs.append(o.transpose(1, 2)[seq, pos])  # [tokens, H, D]
    order = torch.argsort(torch.cat(flats))  # back to the packed row's order
    return torch.cat(outs)[order].transpose(0, 1)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, H, T, D], key/value [1, Hkv, T, D] of a packed row whose
    boundaries are `kwargs["cu_seq_lens_q"]`; returns [1, T, H, D]. Without cu_seqlens (a padded batch), causal
    sdpa with the batch's padding mask."""
    if dropout:
        raise NotImplementedError("trainer.packed_attention=varlen has no attention dropout; set it to 0 in the model")
    if kwargs.get("sliding_window"):
        raise NotImplementedError(
            "trainer.packed_attention=varlen does not do sliding-window attention; use trainer.packed_attention=model"
        )
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return _padded(query, key, value, attention_mask, scaling), None
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got a batch of {query.shape[0]}")
    if kernel_available(query):
        longest = kwargs.get("max_length_q")
        if longest is None:
            longest = query.shape[2]
        out = _kernel(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu, longest, scaling)
        return out.unsqueeze(0), None
    out = _per_sequence(query[0], key[0], value[0], cu, scaling)  # [H, T, D]
    return out.transpose(0, 1).unsqueeze(0), None


def _padded(query, key, value, attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """Causal sdpa over a padded batch [B, H, L, D] (2D mask: 1 at real tokens), returned as [B, L, H, D]."""
    gqa = key.shape[1] != query.shape[1]
    if attention_mask is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    else:
        L = query.shape[2]
        causal = torch.ones(L, L, dtype=torch.bool, device=query.device).tril()
        mask = causal[None, None] & attention_mask[:, None, None, -L:].bool()
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def register() -> None:
    """Make VARLEN a name transformers knows (idempotent): the function above, and FlashAttention's mask rule (no mask
    for packed or unpadded rows, the 2D padding mask otherwise)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, flash_attention_mask)


def resolve(choice: str, attn_implementation: str) -> str:
    """`trainer.packed_attention` for a model built with `attn_implementation`: "varlen" or "model"."""
    if choice not in PACKED_ATTENTION:
        raise ValueError(f"trainer.packed_attention must be one of {PACKED_ATTENTION}, got {choice!r}")
    if choice != "auto":
        return choice
    return "varlen" if attn_implementation == "sdpa" else "model"


def use_packed_attention(model: torch.nn.Module, choice: str, attn_implementation: str) -> str:
    """Switch `model` (an HF PreTrainedModel, before FSDP wraps it) to the packed attention `choice` resolves to;
    returns what it resolved to."""
    resolved = resolve(choice, attn_implementation)
    if resolved == "varlen":
        register()
        model.set_attn_implementation(VARLEN)
        if model.config._attn_implementation != VARLEN:  # packed rows would attend across sequences: refuse
            raise ConfigError(
                f"trainer.packed_attention=varlen: {type(model).__name__} does not take transformers' attention "
                "interface; set trainer.padding_free=false"
            )
        if not (_varlen_attn is not None and torch.cuda.is_available()):
            log.debug("packed attention: one sdpa call per sequence (no CUDA varlen kernel here)")
    return resolved
