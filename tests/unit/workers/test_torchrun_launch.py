"""`cluster=torchrun` before any process group: the layout read from torchrun's environment and checked against
`cluster.*` at validation, the followers' composition (the same config as the app's, nothing written), and the
comparison that refuses a rank whose config differs from rank 0's."""

from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from hybridrl.config import register_configs, validate
from hybridrl.errors import ConfigError
from hybridrl.workers.follower import check_same_config, compose_as_the_app, config_difference
from hybridrl.workers.torchrun_env import check_not_launched, launched_rank

register_configs()

# What torchrun exports to rank 0 of `torchrun --nnodes 2 --nproc_per_node 2`.
TWO_BY_TWO = {
    "RANK": "0",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none",
}
LAUNCH_VARS = (*TWO_BY_TWO, "TORCHELASTIC_RESTART_COUNT")


def composed(*overrides: str):
    with initialize_config_module(config_module="hybridrl.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture()
def no_launcher(monkeypatch):
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.fixture()
def torchrun_2x2(no_launcher):
    for key, value in TWO_BY_TWO.items():
        no_launcher.setenv(key, value)
    return no_launcher


def test_the_layout_follows_torchrun(torchrun_2x2):
    rc = validate(composed("cluster=torchrun", "engine.tp_size=2"))
    assert (rc.cluster.name, rc.cluster.nnodes, rc.cluster.workers_per_node) == ("torchrun", 2, 2)
    assert rc.cluster.world_size == 4 and rc.topology().engine_dp_size == 2


@pytest.mark.parametrize(
    "override, key",
    [("cluster.workers_per_node=4", "cluster.workers_per_node=4"), ("cluster.nnodes=3", "cluster.nnodes=3")],
)
def test_a_layout_the_launcher_did_not_start_fails_naming_the_key(torchrun_2x2, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(composed("cluster=torchrun", override))


def test_torchrun_cluster_without_torchrun_says_how_to_launch(no_launcher):
    with pytest.raises(ConfigError) as err:
        validate(composed("cluster=torchrun"))
    message = str(err.value)
    assert "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set" in message
    assert "torchrun --nnodes N --nproc_per_node G -m hybridrl cluster=torchrun" in message


def test_another_cluster_kind_under_torchrun_is_refused(torchrun_2x2):
    with pytest.raises(ConfigError, match="cluster=local: every rank would run a job of its own"):
        check_not_launched("local")
    check_not_launched("torchrun")
    torchrun_2x2.setenv("WORLD_SIZE", "1")  # a torchrun of one process is one run
    check_not_launched("local")
    torchrun_2x2.setenv("WORLD_SIZE", "4")
    torchrun_2x2.delenv("TORCHELASTIC_RUN_ID")  # RANK alone (another tool's variable) is not torchrun
    check_not_launched("inline")


def test_launched_rank_needs_rank_and_world_size(no_launcher):
    assert launched_rank() is None
    no_launcher.setenv("RANK", "3")
    assert launched_rank() is None
    no_launcher.setenv("WORLD_SIZE", "8")
    assert launched_rank() == 3


def test_a_follower_composes_what_hydra_composes_and_writes_nothing(tmp_path, no_launcher):
    no_launcher.chdir(tmp_path)
    overrides = ["recipe=cpu_ppo", "trainer.lr=3e-4", "engine.tp_size=1", "hydra.run.dir=elsewhere"]
    mine = compose_as_the_app(overrides)
    reference = composed(*overrides)  # Hydra's public compose API, the way the config tests compose
    assert OmegaConf.to_container(mine, resolve=True) == OmegaConf.to_container(reference, resolve=True)
    assert "hydra" not in mine
    assert list(tmp_path.iterdir()) == []  # no run dir, no .hydra/, no log file


def test_commands_that_only_print_and_sweeps(no_launcher):
    assert compose_as_the_app(["--cfg", "job"]) is None
    assert compose_as_the_app(["--help"]) is None
    with pytest.raises(ConfigError, match="one torchrun per run"):
        compose_as_the_app(["-m", "trainer.lr=1e-3,2e-3"])


def test_a_config_that_differs_from_rank_0s_is_named_by_its_first_key():
    rank0 = validate(composed("trainer.lr=1e-3"))
    assert config_difference(rank0, validate(composed("trainer.lr=1e-3"))) is None
    mine = validate(composed("trainer.lr=2e-3"))
    assert config_difference(mine, rank0) == "trainer.lr: 0.002 here, 0.001 on rank 0"
    with pytest.raises(ConfigError, match=r"\(trainer\.lr: 0\.002 here, 0\.001 on rank 0\)"):
        check_same_config(mine, rank0)
    both = validate(composed("trainer.lr=2e-3", "engine.top_k=5"))  # the first in the config's order: engine
    assert config_difference(both, rank0) == "engine.top_k: 5 here, -1 on rank 0"


def test_config_difference_walks_lists_and_dicts():
    @dataclasses.dataclass
    class Section:
        ids: list
        extra: dict

    a = Section([1, 2, 3], {"k": "v"})
    assert config_difference(a, Section([1, 2, 4], {"k": "v"}), "data") == "data.ids[2]: 3 here, 4 on rank 0"
    assert config_difference(a, Section([1, 2, 3], {"k": "w"}), "data") == "data.extra.k: 'v' here, 'w' on rank 0"
    assert config_difference(a, Section([1, 2], {"k": "v"}), "data") == "data.ids: [1, 2, 3] here, [1, 2] on rank 0"
