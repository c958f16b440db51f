"""Our decoder for the Llama / Qwen2 / Qwen3 families, holding one engine TP rank's shard, over a paged KV cache.

Parameter names and shapes are exactly the resharder's "fused" layout for (tp_rank, tp_size), so it is filled by
name (tests check the two agree). A decode step, per layer::

    h → qkv_proj (column-parallel) → [q/k RMSNorm] + RoPE + K/V written at each token's cache slot   (rope_write)
      → paged split-K decode attention (decode_attention) → o_proj (row-parallel) → all-reduce
        (on GPU both in one kernel, `rope_attention`, where its grid is one wave of one program per SM)
      → x, h = x + attn, RMSNorm(x + attn)                                                          (add_rms_norm)
      → gate_up_proj → SiLU(gate)·up (silu_mul) → down_proj (row-parallel) → all-reduce
      → x, h = x + mlp, RMSNorm of the next layer (or the final norm)                              (add_rms_norm)

At ≤ 64 rows the narrow projections (qkv; o_proj and down_proj at TP 1) run as split-K Triton GEMMs whose float32
partials the next kernel sums (`kernels/linear.py`); at more rows down_proj (TP 1) runs as a batched cuBLAS GEMM over
K slices, its float32 partials summed the same way; the rest runs in cuBLAS.

`extend` runs prompt tokens through the same layers, each token a row that reads its sequence's block table (agent
turns past their cached prefix, short new prompts); `prefill` runs long new prompts padded, with flash attention.

Each op is a Triton kernel on GPU (`engine.native.kernels`) and the torch code it replaces elsewhere; the torch
code follows transformers op for op (float32 RMSNorm, RoPE tables cast to the weight dtype), so float32 log-probs
match a trainer's full forward. Embedding and lm_head are vocab-parallel (rows padded to a multiple of 64): a
masked lookup + all-reduce, and logits all-gathered over the group.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridrl.engines.native.architectures import check_supported, mrope_section, rope_tables
from hybridrl.engines.native.kernels import use_triton
from hybridrl.engines.native.kernels.attention import decode_attention, triton_supports
from hybridrl.engines.native.kernels.linear import project
from hybridrl.engines.native.kernels.norms import add_rms_norm, rms_norm, silu_mul
from hybridrl.engines.native.kernels.rope_attention import one_wave, rope_attention
from hybridrl.engines.native.kernels.rope_cache import rope_write, split_qkv_torch, write_kv_torch
from hybridrl.engines.native.kernels.shared_prefix import SharedPrefix, shared_prefix_attention
from hybridrl.engines.native.kv_cache import PagedKVCache
from hybridrl.engines.native.tensor_parallel import TensorParallel
from hybridrl.errors import ConfigError
from hybridrl.models.shape import ModelShape, padded_vocab
from hybridrl.models.vision import text_config

Rope = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""RoPE for a forward's tokens: cos and sin tables (sine signed, `ensure_positions`) and each token's row in them."""

# Flash attention for the (causal, unmasked) prefill; the others as fallbacks.
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


def check_tp(s: ModelShape, tp: int) -> None:
    """The divisibility rules of the fused TP layout (the resharder's, and vLLM's), as a ConfigError up front."""
    if s.heads % tp or (s.kv_heads % tp and tp % s.kv_heads) or s.intermediate % tp or padded_vocab(s.vocab) % tp:
        raise ConfigError(
            f"engine.tp_size={tp} does not split this model: heads {s.heads}, kv heads {s.kv_heads}, "
            f"intermediate {s.intermediate} and padded vocab {padded_vocab(s.vocab)} must divide "
            "by it (kv heads may instead divide it)"
        )


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

    def __init__(
        self, hf_config, tp: TensorParallel, dtype: torch.dtype, device: torch.device, kernels: bool = True
    ) -> None:
        super().__init__()
        check_supported(hf_config)
        self.hf_config, self.tp, self.dtype, self.device = hf_config, tp, dtype, torch.device(device)
        s = self.shape = ModelShape.from_hf_config(hf_config)
        check_tp(s, tp.size)
        self.q_heads, self.kv_heads, self.head_dim = s.heads // tp.size, max(1, s.kv_heads // tp.size), s.head_dim
        self.vocab_rows = padded_vocab(s.vocab) // tp.size
        self.eps = float(getattr(text_config(hf_config), "rms_norm_eps", 1e-6))
        # Multimodal RoPE (Qwen2-VL): each rotary column's axis (temporal, height, width), the column's frequency
        # turning with that axis's position; None for a text model.
        sections = mrope_section(hf_config)
        self.mrope_axes = (
            torch.tensor([a for a, n in enumerate(sections) for _ in range(n)] * 2, device=self.device)
            if sections
            else None
        )
        self.kernels = use_triton(torch.empty(0, device=self.device), kernels)
        # The device's SMs, which the skinny GEMMs and the one-kernel attention plan for (132, an H100/H200's, under
        # Triton's CPU interpreter in tests).
        self.sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 132
        )
        self.model = nn.Module()
        self.model.embed_tokens = _Weights((self.vocab_rows, s.hidden), False, dtype, self.device)
        self.model.layers = nn.ModuleList(FusedLayer(s, tp.size, dtype, self.device) for _ in range(s.num_layers))
        self.model.norm = _Weights((s.hidden,), False, dtype, self.device)
        if not s.tied:
            self.lm_head = _Weights((self.vocab_rows, s.hidden), False, dtype, self.device)
        self.cos = self.sin = torch.empty(0)
        self.ensure_positions(1)

    def paged_attention_kernel(self, block_size: int) -> bool:
        """Whether attention over the paged cache runs the Triton kernel here (else the torch path, which gathers each
        row's context)."""
        return self.kernels and triton_supports(self.head_dim, block_size)

    def one_kernel_attention(self, rows: int, n_splits: int) -> bool:
        """Whether a decode step of `rows` rows (one query each) runs RoPE and attention in one kernel
        (`kernels/rope_attention.py`), where that is faster (`one_wave`); else `rope_write` then `decode_attention`,
        as an extend does."""
        return one_wave(rows, self.kv_heads, n_splits, self.sms)

    def head_weight(self) -> torch.Tensor:
        """The lm_head shard: the embedding's when tied."""
        return (self.model.embed_tokens if self.shape.tied else self.lm_head).weight

    # -- tables -------------------------------------------------------------------------------------
    def ensure_positions(self, length: int) -> bool:
        """RoPE tables for at least `length` positions (decode graphs read them in place: True when they moved)."""
        if self.cos.shape[0] >= length:
            return False
        self.cos, sin = rope_tables(self.hf_config, length, self.dtype, self.device)
        half = sin.shape[-1] // 2
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # signed: rotate_half(x)·sin = swap(x)·sin
        return True

    def mrope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, head_dim] of tokens at multimodal positions [3, N] (a Qwen2-VL model's): column j turns
        with the position of its axis, as transformers' recomposition of the three axes' tables gives it. Token i's
        row of a `Rope` is then i."""
        self.ensure_positions(int(positions.max()) + 1)
        # [N, head_dim]: each column's position; contiguous, so the gathered tables are too (the kernels read rows)
        rows = positions.to(self.device)[self.mrope_axes].T.contiguous()
        cols = torch.arange(self.head_dim, device=self.device)
        return self.cos[rows, cols], self.sin[rows, cols]

    # -- pieces ---------------------------------------------------------------------------------------
    def _embed_with(self, ids: torch.Tensor, images: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """`embed(ids)`, with `images`' embeddings (token indices [M], vectors [M, hidden]) at their tokens."""
        x = self.embed(ids)
        if images is not None:
            x = x.index_copy(0, images[0], images[1].to(x.dtype))
        return x

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
        """x Wᵀ summed over the TP group (+ b); unsharded and bias-free, possibly float32 partials for the
        residual add (`linear.project`)."""
        if self.tp.size == 1 and proj.bias is None:
            return project(x, proj.weight, None, self.sms, self.kernels)
        out = self.tp.all_reduce(F.linear(x, proj.weight))
        return out if proj.bias is None else out + proj.bias  # the bias is added once, after the sum

    def _norms(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's post-attention norm weight, and the norm after its MLP (the next layer's input norm, or the
        final norm)."""
        layers = self.model.layers
        after = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.model.norm.weight
        return layers[i].post_attention_layernorm.weight, after

    def _qk_norms(self, attn: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Qwen3's per-head q and k norm weights (None, None for models without them)."""
        return (attn.q_norm.weight, attn.k_norm.weight) if self.shape.qk_norm else (None, None)

    def _mlp(self, layer: FusedLayer, h: torch.Tensor) -> torch.Tensor:
        m = layer.mlp
        return self._row_parallel(
            m.down_proj, silu_mul(F.linear(h, m.gate_up_proj.weight, m.gate_up_proj.bias), self.kernels)
        )

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [N, padded vocab] (columns past the real vocab are padding) of final-normed hidden states."""
        return self.tp.gather_last(F.linear(h, self.head_weight()))

    # -- forwards -------------------------------------------------------------------------------------
    def prefill(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        slots: torch.Tensor,
        cache: PagedKVCache,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        mrope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run right-padded prompts ids [B, W] (true lengths [B]) from position 0; store each token's K/V at its slot
        (slots [B, W]; padding tokens point into the scratch block); return the logits [B, padded vocab] at each last
        token. Causal flash attention over the prompt itself: the cache is only written. (Sequences continuing a
        cached prefix go through `extend`.) `images` (flat token indices [M], embeddings [M, hidden]): what stands
        at image placeholders instead of their embedding; `mrope`: each token's cos and sin [B·W, head_dim]
        (`mrope_rows`) instead of its position's."""
        b, w = ids.shape
        n, d, eps, kern = b * w, self.head_dim, self.eps, self.kernels
        if mrope is None:
            pos = torch.arange(w, device=ids.device)
            cos, sin = self.cos[pos].repeat(b, 1).view(n, 1, d), self.sin[pos].repeat(b, 1).view(n, 1, d)
        else:
            cos, sin = mrope[0].view(n, 1, d), mrope[1].view(n, 1, d)
        slots = slots.reshape(n)
        x = self._embed_with(ids.reshape(n), images)
        h = rms_norm(x, self.model.layers[0].input_layernorm.weight, eps, kern)
        with _attention_backends(self.device):
            for i, layer in enumerate(self.model.layers):
                a = layer.self_attn
                q, k, v = split_qkv_torch(
                    F.linear(h, a.qkv_proj.weight, a.qkv_proj.bias),
                    self.q_heads,
                    self.kv_heads,
                    cos,
                    sin,
                    *self._qk_norms(a),
                    eps,
                )
                write_kv_torch(*cache.layer(i), slots, k, v)
                # Right padding: a real token attends only to earlier real tokens, so causal suffices.
                o = self._prefill_attention(
                    q.view(b, w, self.q_heads, d).transpose(1, 2),
                    k.view(b, w, self.kv_heads, d),
                    v.view(b, w, self.kv_heads, d),
                )
                post, after = self._norms(i)
                x, h = add_rms_norm(x, self._row_parallel(a.o_proj, o.transpose(1, 2).reshape(n, -1)), post, eps, kern)
                x, h = add_rms_norm(x, self._mlp(layer, h), after, eps, kern)
        last = h.view(b, w, -1)[torch.arange(b, device=h.device), lengths - 1]
        return self.logits(last)

    def _prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal SDPA of q [B, q_heads, W, d] over k, v [B, W, kv_heads, d]."""
        b, length, _, d = k.shape
        g = self.q_heads // self.kv_heads
        # GQA: each kv head serves g consecutive query heads (transformers' repeat_kv order).
        k = k.view(b, length, self.kv_heads, 1, d).expand(b, length, self.kv_heads, g, d).reshape(b, length, -1, d)
        v = v.view(b, length, self.kv_heads, 1, d).expand(b, length, self.kv_heads, g, d).reshape(b, length, -1, d)
        return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=d**-0.5)

    def extend(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        block_table: torch.Tensor,
        table_rows: torch.Tensor,
        cache: PagedKVCache,
        last: torch.Tensor,
        max_len: int,
        n_splits: int = 1,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        """Prompt tokens packed with no padding, each at its position (tokens, positions, cache slots [N]), token i
        of the sequence whose block table is block_table[table_rows[i]]: the logits [len(last), padded vocab] at the
        tokens `last`. A sequence may continue a cached prefix (an agent's next turn) or start at position 0.
        `images` and `rope` as `_layers` takes them (a vision-language prompt's).

        Each token is one row of the decode step: all K/V of a layer are written first, then every token attends
        its sequence's positions ≤ its own through the paged cache, the cached prefix and the new tokens before it
        alike. The same few fused kernels per layer as a decode step, so it can be captured in a CUDA graph too
        (`DecodeRunner.extend`)."""
        h = self._layers(
            tokens, pos, slots, block_table, cache, max_len, n_splits, table_rows, images=images, rope=rope
        )
        return self.logits(h[last])

    def decode(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        block_table: torch.Tensor,
        cache: PagedKVCache,
        max_len: int,
        n_splits: int = 1,
        mixed: tuple[torch.Tensor, ...] | None = None,
        prefix: SharedPrefix | None = None,
        rope_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token per row (tokens, positions, cache slots [B]; block tables [B, blocks]): store its K/V, attend to
        positions ≤ its own; return logits [B, padded vocab]. No host syncs and static shapes, so it can be captured
        in a CUDA graph. `max_len` (> every position) is the torch attention path's gathered width; `n_splits` the
        Triton kernel's key split. `mixed` (ids, positions, slots, rows [E]): prompt tokens of rows joining at this
        step (a mixed step), run as extra rows (as `extend` runs them) whose K/V the rows' own tokens attend in the same
        layer. `prefix`: rows sharing leading blocks read them once per group (`shared_prefix`; Triton attention, no
        mixed tokens). `rope_pos` [B]: the rows' rotary positions where they differ from their cache positions (a
        Qwen2-VL sequence after its images: cache position + the prompt's offset; no mixed tokens)."""
        b = tokens.shape[0]
        if mixed is None:
            rope = None if rope_pos is None else (self.cos, self.sin, rope_pos)
            return self.logits(
                self._layers(tokens, pos, slots, block_table, cache, max_len, n_splits, prefix=prefix, rope=rope)
            )
        if rope_pos is not None:
            raise ValueError("decode: rope_pos with mixed tokens")
        ids, jpos, jslots, jrows = mixed
        rows = torch.cat((torch.arange(b, device=tokens.device), jrows))
        h = self._layers(
            torch.cat((tokens, ids)),
            torch.cat((pos, jpos)),
            torch.cat((slots, jslots)),
            block_table,
            cache,
            max_len,
            n_splits,
            rows,
        )
        return self.logits(h[:b])

    def _layers(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        block_table: torch.Tensor,
        cache: PagedKVCache,
        max_len: int,
        n_splits: int,
        table_rows: torch.Tensor | None = None,
        prefix: SharedPrefix | None = None,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        """The final-normed hidden states [N, hidden] of tokens at positions `pos`, over the paged cache. `images`
        (token indices [M], embeddings [M, hidden]): what stands at those tokens instead of their embedding; `rope`:
        the tokens' RoPE where it is not the tables at `pos` (a Qwen2-VL model's multimodal positions)."""
        eps, kern = self.eps, self.kernels
        # The one-kernel attention reads RoPE at the cache position.
        one_kernel = table_rows is None and rope is None and self.one_kernel_attention(tokens.shape[0], n_splits)
        seq_lens = None if one_kernel else pos + 1
        cos, sin, rope_pos = rope if rope is not None else (self.cos, self.sin, pos)
        grouped = (
            prefix is not None
            and table_rows is None
            and not one_kernel
            and self.paged_attention_kernel(cache.block_size)
        )
        x = self._embed_with(tokens, images)
        h = rms_norm(x, self.model.layers[0].input_layernorm.weight, eps, kern)
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            kc, vc = cache.layer(i)
            qkv = project(h, a.qkv_proj.weight, a.qkv_proj.bias, self.sms, self.kernels)
            if one_kernel:
                o = rope_attention(
                    qkv,
                    self.q_heads,
                    self.kv_heads,
                    self.cos,
                    self.sin,
                    pos,
                    slots,
                    kc,
                    vc,
                    *self._qk_norms(a),
                    eps,
                    block_table,
                    max_len,
                    self.head_dim**-0.5,
                    n_splits,
                    kern,
                )
            else:
                q = rope_write(
                    qkv,
                    self.q_heads,
                    self.kv_heads,
                    cos,
                    sin,
                    rope_pos,
                    slots,
                    kc,
                    vc,
                    *self._qk_norms(a),
                    eps,
                    kern,
                )
                if grouped:
                    o = shared_prefix_attention(q, kc, vc, block_table, seq_lens, self.head_dim**-0.5, prefix)
                else:
                    o = decode_attention(
                        q, kc, vc, block_table, seq_lens, max_len, self.head_dim**-0.5, n_splits, kern, table_rows
                    )
            post, after = self._norms(i)
            x, h = add_rms_norm(x, self._row_parallel(a.o_proj, o.reshape(o.shape[0], -1)), post, eps, kern)
            x, h = add_rms_norm(x, self._mlp(layer, h), after, eps, kern)
        return h
