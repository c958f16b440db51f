"""Our decoder for the Llama / Qwen2 / Qwen3 families, in plain PyTorch, holding one engine TP rank's shard.

Parameter names and shapes are exactly `build_layout(hf_config, "fused", tp_rank, tp_size)`'s specs, so the
resharder fills it by name. Per layer::

    x → RMSNorm → qkv_proj (column-parallel, [Q;K;V] of this rank's heads) → [q_norm/k_norm] → RoPE
      → attention (SDPA) → o_proj (row-parallel) → all-reduce → + residual
      → RMSNorm → gate_up_proj (column-parallel) → SiLU(gate)·up → down_proj (row-parallel) → all-reduce
      → + residual

Embedding and lm_head are vocab-parallel (rows padded to a multiple of 64): a masked lookup + all-reduce,
and logits all-gathered over the group. The math follows transformers op for op (float32 RMSNorm, RoPE
tables cast to the weight dtype), so log-probs match a trainer's full forward.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridrl.engines.fused.groups import TensorParallel
from hybridrl.engines.fused.kv_cache import KVCache
from hybridrl.engines.fused.rope import check_supported, rope_tables
from hybridrl.errors import HybridRLError
from hybridrl.models.shape import ModelShape, padded_vocab
from hybridrl.reshard.layout import build_layout


# Flash (prefill) and memory-efficient (masked decode) kernels: both capture in CUDA graphs and take strided K/V.
_GPU_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _attention_backends(device: torch.device):
    return sdpa_kernel(_GPU_ATTENTION) if device.type == "cuda" else nullcontext()


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class _Weights(nn.Module):
    """A named holder of `weight` and optional `bias` (no forward: the decoder calls F.linear itself)."""

    def __init__(self, shape: tuple[int, ...], bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _param(shape, dtype, device)
        self.bias = _param(shape[:1], dtype, device) if bias else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalize in float32, round to x's dtype, then scale in that dtype.
    F.rms_norm computes in float32 and rounds once, the same steps (one fused kernel on GPU)."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' x·cos + rotate_half(x)·sin over the last dim (x [N, heads, d], tables [N, 1, d]).
    rotate_half(x)·sin = [x_hi, x_lo]·[-sin_lo, sin_hi] exactly (negation is exact): one kernel fewer."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin_signed


class FusedLayer(nn.Module):
    """One decoder layer's parameters (attention + MLP + norms) under their fused-layout names."""

    def __init__(self, s: ModelShape, tp: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        q, kv, d = s.heads // tp, max(1, s.kv_heads // tp), s.head_dim
        attn, mlp = nn.Module(), nn.Module()
        attn.qkv_proj = _Weights(((q + 2 * kv) * d, s.hidden), s.qkv_bias, dtype, device)
        attn.o_proj = _Weights((s.hidden, q * d), s.o_bias, dtype, device)
        if s.qk_norm:
            attn.q_norm = _Weights((d,), False, dtype, device)
            attn.k_norm = _Weights((d,), False, dtype, device)
        mlp.gate_up_proj = _Weights((2 * (s.intermediate // tp), s.hidden), s.mlp_bias, dtype, device)
        mlp.down_proj = _Weights((s.hidden, s.intermediate // tp), s.mlp_bias, dtype, device)
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm = _Weights((s.hidden,), False, dtype, device)
        self.post_attention_layernorm = _Weights((s.hidden,), False, dtype, device)


class FusedDecoder(nn.Module):
    """A causal LM shard: `model.embed_tokens`, `model.layers.{i}.…`, `model.norm`, `lm_head` (untied only)."""

    def __init__(self, hf_config, tp: TensorParallel, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        check_supported(hf_config)
        self.hf_config, self.tp, self.dtype, self.device = hf_config, tp, dtype, torch.device(device)
        s = self.shape = ModelShape.from_hf_config(hf_config)
        layout = build_layout(hf_config, "fused", tp.rank, tp.size)  # also checks TP divisibility
        self.q_heads, self.kv_heads, self.head_dim = s.heads // tp.size, max(1, s.kv_heads // tp.size), s.head_dim
        self.vocab_rows = padded_vocab(s.vocab) // tp.size
        self.eps = float(getattr(hf_config, "rms_norm_eps", 1e-6))
        self.model = nn.Module()
        self.model.embed_tokens = _Weights((self.vocab_rows, s.hidden), False, dtype, self.device)
        self.model.layers = nn.ModuleList(FusedLayer(s, tp.size, dtype, self.device) for _ in range(s.num_layers))
        self.model.norm = _Weights((s.hidden,), False, dtype, self.device)
        if not s.tied:
            self.lm_head = _Weights((self.vocab_rows, s.hidden), False, dtype, self.device)
        got = {n: tuple(p.shape) for n, p in self.named_parameters()}
        want = {spec.name: spec.shape for spec in layout.specs()}
        if got != want:  # a guarantee, not a hope: the resharder fills exactly these tensors
            diff = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))
            raise HybridRLError(f"fused decoder: parameters differ from the fused layout: {diff}")
        self.cos = self.sin = torch.empty(0)
        self.ensure_positions(1)

    def head_weight(self) -> torch.Tensor:
        """The lm_head shard: the embedding's when tied."""
        return (self.model.embed_tokens if self.shape.tied else self.lm_head).weight

    # -- tables -------------------------------------------------------------------------------------
    def ensure_positions(self, length: int) -> None:
        """RoPE tables for at least `length` positions (the decode graphs read them in place)."""
        if self.cos.shape[0] < length:
            self.cos, sin = rope_tables(self.hf_config, length, self.dtype, self.device)
            half = sin.shape[-1] // 2
            self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # signed for `rope`

    # -- pieces ---------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of flat token ids [N] → [N, hidden]; vocab-parallel: masked lookup + all-reduce."""
        w = self.model.embed_tokens.weight
        if self.tp.size == 1:
            return F.embedding(ids, w)
        local = ids - self.tp.rank * self.vocab_rows
        outside = (local < 0) | (local >= self.vocab_rows)
        x = F.embedding(local.masked_fill(outside, 0), w).masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)

    def _row_parallel(self, proj: _Weights, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, proj.weight))
        return out if proj.bias is None else out + proj.bias  # the bias is added once, after the sum

    def _qkv(self, layer: FusedLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [N, q_heads, d], k and v [N, kv_heads, d] of normed hidden states x [N, hidden], RoPE applied."""
        a, n, d, hq = layer.self_attn, x.shape[0], self.head_dim, self.q_heads
        qkv = F.linear(x, a.qkv_proj.weight, a.qkv_proj.bias).view(n, hq + 2 * self.kv_heads, d)
        qk, v = qkv[:, : hq + self.kv_heads], qkv[:, hq + self.kv_heads :]
        if self.shape.qk_norm:
            qk = torch.cat((rms_norm(qk[:, :hq], a.q_norm.weight, self.eps),
                            rms_norm(qk[:, hq:], a.k_norm.weight, self.eps)), dim=1)
        qk = rope(qk, cos, sin)  # q and k heads together: one RoPE pass
        return qk[:, :hq], qk[:, hq:], v

    def _mlp_block(self, layer: FusedLayer, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
        m = layer.mlp
        gate, up = F.linear(h, m.gate_up_proj.weight, m.gate_up_proj.bias).chunk(2, dim=-1)
        return x + self._row_parallel(m.down_proj, F.silu(gate) * up)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [N, padded vocab] (columns past the real vocab are padding) of final hidden states [N, hidden]."""
        h = rms_norm(x, self.model.norm.weight, self.eps)
        return self.tp.gather_last(F.linear(h, self.head_weight()))

    # -- forwards -------------------------------------------------------------------------------------
    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache, slot: int, repeat: int) -> torch.Tensor:
        """Run right-padded prompts ids [B, W] (true lengths [B]); store their K/V in slots slot.. (each prompt
        `repeat` times); return the logits [B, padded vocab] at each prompt's last token."""
        b, w = ids.shape
        n, d = b * w, self.head_dim
        x = self.embed(ids.reshape(-1))
        cos = self.cos[:w].expand(b, w, d).reshape(n, 1, d)
        sin = self.sin[:w].expand(b, w, d).reshape(n, 1, d)
        with _attention_backends(self.device):
            x = self._prefill_layers(x, b, w, cos, sin, cache, slot, repeat)
        last = x.view(b, w, -1)[torch.arange(b, device=x.device), lengths - 1]
        return self.logits(last)

    def _prefill_layers(self, x: torch.Tensor, b: int, w: int, cos: torch.Tensor, sin: torch.Tensor,
                        cache: KVCache, slot: int, repeat: int) -> torch.Tensor:
        n, d, g = b * w, self.head_dim, self.q_heads // self.kv_heads
        for i, layer in enumerate(self.model.layers):
            q, k, v = self._qkv(layer, rms_norm(x, layer.input_layernorm.weight, self.eps), cos, sin)
            cache.write_prefill(i, slot, k.view(b, w, self.kv_heads, d), v.view(b, w, self.kv_heads, d), repeat)
            q = q.view(b, w, self.q_heads, d).transpose(1, 2)
            # GQA: each kv head serves g consecutive query heads (transformers' repeat_kv order).
            k = k.view(b, w, self.kv_heads, 1, d).expand(b, w, self.kv_heads, g, d).reshape(b, w, self.q_heads, d)
            v = v.view(b, w, self.kv_heads, 1, d).expand(b, w, self.kv_heads, g, d).reshape(b, w, self.q_heads, d)
            # Right padding: a real token attends only to earlier real tokens, so the causal mask suffices.
            o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=d**-0.5)
            x = x + self._row_parallel(layer.self_attn.o_proj, o.transpose(1, 2).reshape(n, self.q_heads * d))
            x = self._mlp_block(layer, x)
        return x

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, key_idx: torch.Tensor,
               cache: KVCache) -> torch.Tensor:
        """One token per slot 0..B-1 (tokens, positions [B]; rows = arange(B); key_idx = arange(L) with L > every
        position): store its K/V, attend to positions ≤ its own; return logits [B, padded vocab].
        No host syncs and static shapes, so it can be captured in a CUDA graph."""
        b, d, g, length = tokens.shape[0], self.head_dim, self.q_heads // self.kv_heads, key_idx.shape[0]
        x = self.embed(tokens)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        # Additive mask [B, 1, 1, L], built once per step rather than converted from bool in every layer.
        mask = torch.zeros(b, 1, 1, length, dtype=x.dtype, device=x.device)
        mask.masked_fill_((key_idx[None, :] > pos[:, None])[:, None, None, :], float("-inf"))
        with _attention_backends(self.device):
            for i, layer in enumerate(self.model.layers):
                q, k, v = self._qkv(layer, rms_norm(x, layer.input_layernorm.weight, self.eps), cos, sin)
                cache.write_decode(i, rows, pos, k, v)
                kc, vc = cache.view(i, b, length)
                # The g query heads of one kv head ride in SDPA's query-length dim: GQA with no K/V repeat.
                q = q.view(b, self.kv_heads, g, d)
                o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=d**-0.5)
                x = x + self._row_parallel(layer.self_attn.o_proj, o.reshape(b, self.q_heads * d))
                x = self._mlp_block(layer, x)
        return self.logits(x)
