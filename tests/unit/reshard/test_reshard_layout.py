"""Weight layouts against hand-built expectations (no processes, no FSDP)."""

from __future__ import annotations

import pytest
import torch

from hybridrl.errors import ConfigError
from hybridrl.models.shape import ModelShape, padded_vocab
from hybridrl.reshard import build_layout, reference_shard
from tests.tiny_models import KINDS, tiny_config, tiny_model


def _full(kind: str, **overrides) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in tiny_model(kind, **overrides).named_parameters()}


def _head(w: torch.Tensor, d: int, h: int) -> torch.Tensor:
    return w[h * d : (h + 1) * d]


@pytest.mark.parametrize("kind", KINDS)
def test_hf_shapes_match_the_transformers_model(kind):
    model = tiny_model(kind)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert ModelShape.from_hf_config(model.config).hf_shapes() == expected


def test_stream_order_embed_layers_final():
    layout = build_layout(tiny_config("llama"), "fused", 0, 2)
    assert [g.name for g in layout.groups] == ["embed", "layers.0", "layers.1", "final"]
    assert [s.name for s in layout.group("final").specs] == ["model.norm.weight", "lm_head.weight"]


def test_gqa_kv_heads_replicated_when_tp_exceeds_kv_heads():
    # qwen2 tiny: 4 q heads, 1 kv head, head_dim 8, with bias. tp=4: rank r = [q head r; k head 0; v head 0].
    cfg, full = tiny_config("qwen2"), _full("qwen2")
    a = "model.layers.1.self_attn"
    q, k, v = (full[f"{a}.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj"))
    for r in range(4):
        spec = build_layout(cfg, "fused", r, 4).spec(f"{a}.qkv_proj.weight")
        assert spec.shape == (3 * 8, 32)
        assert spec.sources == tuple(f"{a}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj"))
        assert (spec.fuse_dim, spec.tp_dim) == (0, 0)
        assert torch.equal(spec.build(full), torch.cat([q[r * 8 : r * 8 + 8], k, v]))


def test_gqa_kv_head_is_rank_over_replicas():
    # llama tiny: 4 q heads, 2 kv heads, head_dim 10. tp=4: kv head r // 2; tp=2: one kv head per rank.
    cfg, full = tiny_config("llama"), _full("llama")
    a = "model.layers.0.self_attn"
    q, k, v = (full[f"{a}.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj"))
    for tp, expected_kv in ((4, [0, 0, 1, 1]), (2, [0, 1])):
        for r in range(tp):
            got = build_layout(cfg, "fused", r, tp).spec(f"{a}.qkv_proj.weight").build(full)
            qh = torch.cat([_head(q, 10, h) for h in range(r * 4 // tp, (r + 1) * 4 // tp)])
            kh = expected_kv[r]
            assert torch.equal(got, torch.cat([qh, _head(k, 10, kh), _head(v, 10, kh)]))


def test_qwen2_has_qkv_bias_and_no_o_bias():
    cfg, full = tiny_config("qwen2"), _full("qwen2")
    layout = build_layout(cfg, "fused", 1, 2)
    names = {s.name for s in layout.specs()}
    a = "model.layers.0.self_attn"
    assert f"{a}.qkv_proj.bias" in names and f"{a}.o_proj.bias" not in names
    qb, kb, vb = (full[f"{a}.{p}.bias"] for p in ("q_proj", "k_proj", "v_proj"))
    # rank 1 of 2: q heads 2,3 (rows 16:32), the single kv head (replicated).
    assert torch.equal(layout.spec(f"{a}.qkv_proj.bias").build(full), torch.cat([qb[16:32], kb, vb]))


def test_qwen3_q_norm_k_norm_replicated_and_no_bias():
    cfg, full = tiny_config("qwen3"), _full("qwen3")
    layout = build_layout(cfg, "fused", 1, 2)
    a = "model.layers.1.self_attn"
    for norm in ("q_norm", "k_norm"):
        spec = layout.spec(f"{a}.{norm}.weight")
        assert spec.tp_dim is None and spec.shape == (16,)
        assert torch.equal(spec.build(full), full[f"{a}.{norm}.weight"])
    assert not any(s.name.endswith(".bias") for s in layout.specs())
    # head_dim 16 (not 34 // 4): rank 1 holds q heads 2,3 → rows 32:64; kv head 1 → rows 16:32.
    q, k, v = (full[f"{a}.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj"))
    assert torch.equal(layout.spec(f"{a}.qkv_proj.weight").build(full), torch.cat([q[32:64], k[16:32], v[16:32]]))


def test_row_parallel_and_gate_up():
    cfg, full = tiny_config("llama"), _full("llama")
    layout = build_layout(cfg, "fused", 1, 2)
    m, a = "model.layers.0.mlp", "model.layers.0.self_attn"
    gate, up = full[f"{m}.gate_proj.weight"], full[f"{m}.up_proj.weight"]
    down, o = full[f"{m}.down_proj.weight"], full[f"{a}.o_proj.weight"]
    assert torch.equal(layout.spec(f"{m}.gate_up_proj.weight").build(full), torch.cat([gate[24:48], up[24:48]]))
    assert torch.equal(layout.spec(f"{m}.down_proj.weight").build(full), down[:, 24:48])
    assert torch.equal(layout.spec(f"{a}.o_proj.weight").build(full), o[:, 20:40])
    assert layout.spec(f"{a}.o_proj.weight").tp_dim == 1


def test_vocab_padded_to_64_then_split():
    cfg, full = tiny_config("llama"), _full("llama")  # vocab 99 → 128
    assert padded_vocab(99) == 128 and padded_vocab(128) == 128
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = full[name]
        shards = [build_layout(cfg, "fused", r, 4).spec(name).build(full) for r in range(4)]
        assert all(s.shape == (32, 40) for s in shards)
        assert torch.equal(torch.cat(shards[:3]), w[:96])
        assert torch.equal(shards[3][:3], w[96:99]) and not shards[3][3:].any()
        # hf style: the full, unpadded tensor
        assert torch.equal(build_layout(cfg, "hf", 0, 4).spec(name).build(full), w)


@pytest.mark.parametrize("style", ["hf", "fused"])
def test_tied_embeddings_send_no_lm_head(style):
    names = {s.name for s in build_layout(tiny_config("qwen2"), style, 0, 2).specs()}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    untied = {s.name for s in build_layout(tiny_config("qwen2", tie_word_embeddings=False), style, 0, 2).specs()}
    assert "lm_head.weight" in untied


def test_llama_attention_and_mlp_bias():
    bias = dict(attention_bias=True, mlp_bias=True)
    cfg, full = tiny_config("llama", **bias), _full("llama", **bias)
    layout = build_layout(cfg, "fused", 0, 2)
    a, m = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert torch.equal(layout.spec(f"{a}.o_proj.bias").build(full), full[f"{a}.o_proj.bias"])  # replicated
    assert torch.equal(layout.spec(f"{m}.down_proj.bias").build(full), full[f"{m}.down_proj.bias"])
    gb, ub = full[f"{m}.gate_proj.bias"], full[f"{m}.up_proj.bias"]
    assert torch.equal(layout.spec(f"{m}.gate_up_proj.bias").build(full), torch.cat([gb[:24], ub[:24]]))


def test_hf_style_is_identity_and_units_keep_fused_groups_together():
    cfg, full = tiny_config("qwen2"), _full("qwen2")
    layout = build_layout(cfg, "hf", 0, 1)
    assert {s.name for s in layout.specs()} == set(full)
    for spec in layout.specs():
        assert spec.build(full) is full[spec.name]
    units = [[s.name.split(".")[-2] for s in u] for u in layout.group("layers.0").units()]
    assert sorted(units[0]) == ["k_proj", "k_proj", "q_proj", "q_proj", "v_proj", "v_proj"]  # weights and biases
    assert ["gate_proj", "up_proj"] in units


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_spec_matches_the_independent_reference(kind, tp):
    cfg, full = tiny_config(kind), _full(kind)
    for r in range(tp):
        layout = build_layout(cfg, "fused", r, tp)
        for spec in layout.specs():
            got = spec.build(full)
            assert got.shape == spec.shape, spec.name
            assert torch.equal(got, reference_shard(cfg, spec.name, full, tp_rank=r, tp_size=tp)), spec.name


def test_bad_tp_sizes_are_config_errors():
    with pytest.raises(ConfigError, match="num_attention_heads"):
        build_layout(tiny_config("llama"), "fused", 0, 3)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        build_layout(tiny_config("llama", num_attention_heads=8, num_key_value_heads=3, hidden_size=48), "fused", 0, 2)
    with pytest.raises(ConfigError, match="style"):
        build_layout(tiny_config("llama"), "megatron", 0, 1)
    with pytest.raises(ConfigError, match="tp_rank"):
        build_layout(tiny_config("llama"), "fused", 2, 2)
