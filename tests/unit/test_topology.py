"""The run's layout in one place: Topology's arithmetic against hand-written tables, and no other module doing it."""

from __future__ import annotations

import re

import pytest

from hybridrl.errors import ConfigError
from hybridrl.topology import Topology
from tests.paths import REPO


def test_four_workers_tp_two_as_in_the_docstring_table():
    topo = Topology(4, 2)
    assert [topo.of_rank(r).engine_tp_rank for r in range(4)] == [0, 1, 0, 1]
    assert [topo.of_rank(r).engine_dp_rank for r in range(4)] == [0, 0, 1, 1]
    assert [topo.of_rank(r).engine_tp_ranks for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert topo.engine_leaders() == [0, 2]
    assert topo.prompt_slices(16) == [slice(0, 8), slice(8, 16)]
    assert [topo.of_rank(r).prompt_slice(16) for r in range(4)] == [slice(0, 8)] * 2 + [slice(8, 16)] * 2
    assert topo.row_slices(128) == [slice(0, 32), slice(32, 64), slice(64, 96), slice(96, 128)]


def test_uneven_prompts_and_padding():
    topo = Topology(3, 1)
    assert topo.prompt_slices(7) == [slice(0, 3), slice(3, 6), slice(6, 7)]  # ceil share, the last one short
    assert topo.prompt_slices(2) == [slice(0, 1), slice(1, 2), slice(2, 2)]  # a replica may get none
    assert topo.padding_rows(7) == 2 and topo.padding_rows(9) == 0
    with pytest.raises(ValueError, match="cannot split 7 rows into 3"):
        topo.row_slices(7)


@pytest.mark.parametrize(
    "world, tp, prompts, group, mini, needle",
    [
        (4, 3, 8, 2, 0, "engine.tp_size=3 must divide the number of workers (4)"),
        (4, 1, 3, 2, 0, "data.train_batch_size * algorithm.group_size = 6 samples must divide evenly over 4 workers"),
        (4, 2, 3, 4, 0, "data.train_batch_size=3 must divide over the 2 engine groups"),
        (2, 1, 4, 4, 6, "trainer.mini_batch_size=6 must divide the 16 samples per step"),
    ],
)
def test_layout_errors_name_the_keys(world, tp, prompts, group, mini, needle):
    with pytest.raises(ConfigError) as e:
        Topology(world, tp).check_batch(prompts, group, mini)
    assert needle in str(e.value)


def test_no_other_module_computes_ranks_or_slices():
    """TP/DP ranks, replica groups and prompt slices are derived in hybridrl/topology.py only."""
    pattern = re.compile(
        r"rank\s*(%|//)\s*(?![ds]\b)[A-Za-z_(]"  # rank % tp, rank // tp (not "rank %d" in a message)
        r"|(%|//)\s*(self\.)?(engine_)?tp_size\b"  # x % tp_size, x // self.tp_size
        r"|(%|//)\s*(self\.)?engine_dp_size\b"
        r"|range\(0,\s*world"  # walking the replicas by hand
        r"|new_group\("  # process groups made elsewhere
    )
    root = REPO / "hybridrl"
    offenders = [
        f"{path.relative_to(root.parent)}:{i}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "topology.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line.split("#")[0])
    ]
    assert not offenders, "layout arithmetic outside Topology:\n" + "\n".join(offenders)
