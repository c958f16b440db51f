"""Sequence parallelism on one process: the layout by hand, the slices of a packed row, the KV-head repeat, the
checks at composition and the fit estimate. The multi-process equality with sequence parallel 1 is
test_sequence_parallel_multiproc.py."""

from __future__ import annotations

import json

import pytest
import torch

from hybridrl.batch import Batch
from hybridrl.config import register_configs, validate
from hybridrl.errors import ConfigError
from hybridrl.topology import Topology
from hybridrl.training.memory_estimate import EngineMemory, MemoryInputs, ModelDims, estimate_phases
from hybridrl.training.micro_batches import Batching, make_micro_batches
from hybridrl.training.packing import pack_rows
from hybridrl.training.sequence_parallel import SequenceParallel
from hybridrl.training.ulysses import kv_repeats, use_training_attention
from tests.unit.training.test_packed_trainer import ragged_rollout

PAD = 0


# -- the layout -------------------------------------------------------------------------------
def test_four_workers_sequence_parallel_two_as_in_the_docstring_table():
    topo = Topology(4, 1, 0, 2)
    assert [topo.of_rank(r).sp_rank for r in range(4)] == [0, 1, 0, 1]
    assert [topo.of_rank(r).dp_rank for r in range(4)] == [0, 0, 1, 1]
    assert [topo.of_rank(r).sp_ranks for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert topo.dp_size == 2 and topo.dp_leaders() == [0, 2]
    assert topo.dp_row_slices(128) == [slice(0, 64), slice(64, 128)]
    # Reward scoring is not sequence parallel: every rank its own quarter, as without SP.
    assert topo.row_slices(128) == [slice(0, 32), slice(32, 64), slice(64, 96), slice(96, 128)]


def test_without_sequence_parallelism_the_data_parallel_ranks_are_the_workers():
    topo = Topology(4, 2)
    assert topo.dp_size == 4 and topo.dp_leaders() == [0, 1, 2, 3]
    assert topo.dp_row_slices(8) == topo.row_slices(8)
    assert topo.sequence_parallel_group("cpu") is None  # no group, no collective


def test_a_mini_batch_splits_over_the_data_parallel_ranks():
    Topology(4, 1, 0, 2).check_batch(4, 4, mini_batch_size=2)  # 2 per SP group of 2
    with pytest.raises(ConfigError, match="multiple of the 4 workers"):
        Topology(4, 1, 0, 1).check_batch(4, 4, mini_batch_size=2)
    with pytest.raises(ConfigError, match="multiple of the 2 data-parallel ranks"):
        Topology(4, 1, 0, 2).check_batch(4, 4, mini_batch_size=3)


def test_a_degree_that_does_not_divide_the_workers_is_refused():
    with pytest.raises(ConfigError, match=r"trainer.sequence_parallel_size=4 must .* divide the number of workers \(2"):
        Topology(2, 1, 0, 4)


# -- slices of a packed row -----------------------------------------------------------------------
def packed_rollout(degree: int):
    batch = ragged_rollout(rows=5)
    lengths = batch["response_mask"].sum(-1).long().tolist()
    mask = batch["response_mask"].clone()
    mask[2, :3] = 0  # a row whose first response tokens are out of the loss: kept positions need not be contiguous
    return batch, pack_rows(batch.prompts, batch["responses"], mask, lengths, PAD, multiple_of=degree)


@pytest.mark.parametrize("degree", [2, 3, 4])
def test_slices_partition_the_row_and_its_scored_positions(degree):
    batch, packed = packed_rollout(degree)
    total = packed.computed_tokens
    assert total % degree == 0 and total - packed.real_tokens < 8 * degree  # the tail rounds to both
    shards = [SequenceParallel(None, r, degree).shard(packed) for r in range(degree)]
    # The slices are the row, in order; positions and boundaries are the whole row's (computed before slicing).
    assert torch.equal(torch.cat([s.local.input_ids for s in shards], 1), packed.input_ids)
    assert torch.equal(torch.cat([s.local.position_ids for s in shards], 1), packed.position_ids)
    assert all(torch.equal(s.local.cu_seqlens, packed.cu_seqlens) for s in shards)
    assert sum(s.real_tokens for s in shards) == packed.real_tokens
    assert all(s.computed_tokens == total // degree for s in shards)
    # Each slice predicts with its own logits the targets at its kept positions: the row's tokens one further on.
    for r, s in enumerate(shards):
        n_real = s.local.flat_index.shape[0]
        row_positions = s.kept[:n_real] + r * (total // degree)
        assert torch.equal(s.targets[:n_real], packed.input_ids[0, row_positions + 1])
    # Putting every slice's values in place and adding them up gives the whole row's result, each token once.
    values = torch.arange(1.0, packed.kept.numel() + 1)
    want = packed.scatter(values)
    by_position = dict(zip(packed.kept.tolist(), values.tolist()))
    got = sum(
        s.local.scatter(torch.tensor([by_position.get(k + r * (total // degree), -1.0) for k in s.kept.tolist()]))
        for r, s in enumerate(shards)
    )
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_slice_with_nothing_to_score_keeps_one_dummy_position():
    prompts, responses = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]], torch.tensor([[20, 21]])
    packed = pack_rows(prompts, responses, torch.ones(1, 2), [2], PAD, multiple_of=2)  # 14 real tokens → 16
    first, second = (SequenceParallel(None, r, 2).shard(packed) for r in range(2))
    assert first.kept.tolist() == [0] and first.local.flat_index.numel() == 0  # scores nothing, stays in the graph
    assert second.kept.tolist() == [11 - 8, 12 - 8] and second.local.flat_index.tolist() == [0, 1]
    assert torch.equal(first.local.scatter(torch.tensor([9.0])), torch.zeros(1, 2))


def test_token_budgets_stay_per_device_under_sequence_parallelism():
    batch = ragged_rollout(rows=8)
    lengths = [len(p) + int(n) for p, n in zip(batch.prompts, batch["response_mask"].sum(-1))]
    sp = SequenceParallel(None, 1, 2)
    micro = make_micro_batches(batch, Batching(rows=3, max_tokens=24), torch.device("cpu"), PAD, sp)
    assert sorted(r for m in micro for r in m.rows) == list(range(8))  # every row once
    # A micro-batch holds up to 2 x 24 tokens (a longer sequence alone); this rank computes half of its row.
    assert len(micro) in (-(-sum(lengths) // 48), -(-sum(lengths) // 48) + 1)  # the fewest, or one more to fit
    for m in micro:
        whole = sum(lengths[i] for i in m.rows)
        assert whole <= 48 or len(m.rows) == 1
        assert m.computed_tokens == m.packed.local.input_ids.shape[1] and whole <= 2 * m.computed_tokens < whole + 16
        assert m.computed_tokens <= 24 or len(m.rows) == 1


# -- heads ------------------------------------------------------------------------------------------
def test_kv_heads_repeat_up_to_the_least_common_multiple():
    # (KV heads, degree) → repeats: lcm(kv, degree) / kv
    cases = {(1, 2): 2, (2, 2): 1, (2, 4): 2, (4, 2): 1, (3, 2): 2, (6, 4): 2, (4, 8): 2, (1, 8): 8}
    assert {k: kv_repeats(*k) for k in cases} == cases


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    register_configs()
    with initialize_config_module(config_module="hybridrl.conf", version_base="1.3"):
        return validate(hydra_compose(config_name="config", overrides=overrides))


LOCAL4 = ["cluster=local", "cluster.workers_per_node=4", "data.train_batch_size=4"]


def test_the_tiny_model_composes_at_degree_two_with_its_kv_head_repeated():
    cfg = compose([*LOCAL4, "trainer.sequence_parallel_size=2"])  # 2 query heads, 1 KV head
    assert cfg.topology(3).dp_rank == 1 and cfg.topology(3).sp_rank == 1


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            ["trainer.sequence_parallel_size=4"],
            "trainer.sequence_parallel_size=4 must divide the attention heads of the tiny model "
            "(model.tiny.num_heads) (num_attention_heads=2, num_key_value_heads=1)",
        ),
        (["cluster.workers_per_node=2", "trainer.sequence_parallel_size=4"], "divide the number of workers (2"),
        (["trainer.sequence_parallel_size=2", "trainer.padding_free=false"], "needs trainer.padding_free=true"),
        (["trainer.sequence_parallel_size=2", "trainer.packed_attention=model"], "trainer.packed_attention=varlen"),
        (["trainer.sequence_parallel_size=0"], "trainer.sequence_parallel_size must be >= 1"),
    ],
)
def test_a_degree_the_run_cannot_take_fails_at_composition_naming_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        compose([*LOCAL4, *overrides])
    assert needle in str(e.value)


def test_heads_are_read_from_config_json_alone_before_any_weights(tmp_path):
    folder = tmp_path / "qwen-like"
    folder.mkdir()
    config = {"model_type": "qwen2", "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896}
    (folder / "config.json").write_text(json.dumps(config))  # no weights, no tokenizer
    with pytest.raises(ConfigError) as e:
        compose([*LOCAL4, "model=hf", f"model.path={folder}", "trainer.sequence_parallel_size=4"])
    assert f"model.path={folder}" in str(e.value) and "num_attention_heads=14, num_key_value_heads=2" in str(e.value)
    assert "pick a degree that divides 14" in str(e.value)


def test_a_model_whose_heads_do_not_divide_is_refused_when_built_too():
    from hybridrl.training.config import TrainerConfig
    from tests.tiny_models import tiny_model

    model = tiny_model("qwen2")  # 4 query heads, 1 KV head
    with pytest.raises(ConfigError, match="num_attention_heads=4, num_key_value_heads=1"):
        use_training_attention(model, TrainerConfig(), "sdpa", sequence_parallel_size=8)
    use_training_attention(model, TrainerConfig(), "sdpa", sequence_parallel_size=4)
    assert model.config._attn_implementation == "hybridrl_ulysses"


# -- the fit estimate ---------------------------------------------------------------------------------
def test_the_estimate_divides_activations_and_logits_by_the_degree():
    dims = ModelDims(
        params=10**9, layers=24, hidden=2048, q_dim=2048, kv_dim=256, intermediate=8192, vocab=151936, tied=True
    )
    tokens = dict(update_tokens=32768, logprob_tokens=32768, critic_tokens=32768)
    inp = MemoryInputs(dims, 4, 2, kept_fraction=0.9, engine=EngineMemory(1.0, 2.0, 3.0), critic=True, **tokens)
    one, two = estimate_phases(inp), estimate_phases(inp.with_(sequence_parallel=2))
    for phase in ("logprob", "update", "values", "update_critic"):
        assert two[phase]["activations"] == pytest.approx(one[phase]["activations"] / 2), phase
        for part in ("params", "grads", "optimizer", "others"):  # sharded over every rank either way
            assert two[phase].get(part) == one[phase].get(part), (phase, part)
    assert two["update"]["logits"] == pytest.approx(one["update"]["logits"] / 2)


def test_batch_select_keeps_each_sequence_parallel_rank_on_the_same_rows():
    batch = Batch([[1], [2], [3], [4]], {"x": torch.arange(4.0)[:, None]})
    topo = Topology(4, 1, 0, 2)
    shards = [batch.select(topo.dp_row_slices(4)[topo.of_rank(r).dp_rank]).prompts for r in range(4)]
    assert shards == [[[1], [2]], [[1], [2]], [[3], [4]], [[3], [4]]]
