"""Checkpoint integrity (checksums, verified resume, keep_last) and loading that runs no code from a checkpoint."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
from pathlib import Path

import pytest
import torch

from hybridrl.checkpoints import CheckpointDir, read_meta, verify
from hybridrl.errors import CheckpointError
from hybridrl.training.checkpoint import (
    SafeLoadPlanner,
    load_model_weights,
    load_trainer,
    read_rank_state,
    rng_state,
    set_rng_state,
)

SHARD = "dcp/__0_0.distcp"


class Planted:
    """What an attacker leaves in a checkpoint: unpickling it creates `marker` (standing in for any command)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


@pytest.fixture()
def trainer(tiny_path, tokenizer, process_group):
    from tests.helpers.roles import make_actor

    return make_actor(tiny_path)


def save(ckpt: CheckpointDir, trainer, step: int, sub: dict[str, bytes] | None = None) -> Path:
    tmp = ckpt.staging(step)
    trainer.save(str(tmp))
    for rel, data in (sub or {}).items():  # another role (critic, adapters) writing into a subfolder
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    return ckpt.publish(tmp, step, {"loader": {"epoch": 0, "offset": step}})


def overwrite(path: Path, offset: int, n: int = 4096) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(n))


def test_manifest_lists_every_file_with_its_sha256(tmp_path, trainer):
    import hashlib

    path = save(CheckpointDir(tmp_path, 2), trainer, 3, sub={"critic/state.bin": b"critic bytes"})
    files = read_meta(path)["files"]
    on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != "meta.json")
    assert sorted(files) == on_disk and {"dcp/.metadata", SHARD, "rank0.pt", "critic/state.bin"} <= set(files)
    assert files["critic/state.bin"] == {"bytes": 12, "sha256": hashlib.sha256(b"critic bytes").hexdigest()}
    verify(path)  # no error


def test_4kb_overwritten_in_a_dcp_shard_fails_explicit_resume_naming_the_file(tmp_path, trainer):
    ckpt = CheckpointDir(tmp_path, 2)
    path = save(ckpt, trainer, 3)
    size = (path / SHARD).stat().st_size
    assert size > 3 * 4096
    overwrite(path / SHARD, size // 2)
    assert (path / SHARD).stat().st_size == size  # same size: only the checksum can tell
    with pytest.raises(CheckpointError, match=rf"step_000003: file {SHARD} fails its sha256 check"):
        CheckpointDir(tmp_path, 2).resolve(str(path))


def test_auto_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path, trainer, caplog):
    ckpt = CheckpointDir(tmp_path, 3)
    save(ckpt, trainer, 3)
    newest = save(ckpt, trainer, 6)
    overwrite(newest / SHARD, 4096)
    with caplog.at_level(logging.WARNING, logger="hybridrl"):
        assert CheckpointDir(tmp_path, 3).resolve("auto") == tmp_path / "checkpoints" / "step_000003"
    text = caplog.text
    assert f"skipping step_000006: checkpoint {newest}: file {SHARD} fails its sha256 check" in text
    assert "resuming from step_000003" in text


def test_auto_with_no_checkpoint_that_verifies_is_an_error(tmp_path, trainer):
    ckpt = CheckpointDir(tmp_path, 2)
    path = save(ckpt, trainer, 3)
    overwrite(path / "rank0.pt", 0, 64)
    with pytest.raises(CheckpointError, match="none of the 1 checkpoints"):
        CheckpointDir(tmp_path, 2).resolve("auto")
    assert CheckpointDir(tmp_path / "empty", 2).resolve("auto") is None  # nothing at all: a fresh start


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: (p / "rank0.pt").unlink(), "file rank0.pt is missing"),
        (lambda p: (p / "notes.txt").write_text("x"), "file notes.txt is not in its manifest"),
        (lambda p: os.truncate(p / SHARD, 100), f"file {SHARD} has 100 bytes"),
        (lambda p: (p / "meta.json").write_text("{"), "meta.json cannot be read"),
        (lambda p: (p / "meta.json").write_text(json.dumps({"step": 3, "loader": {}})), "has no file checksums"),
    ],
    ids=["missing", "added", "truncated", "meta-not-json", "no-manifest"],
)
def test_each_kind_of_damage_is_named(tmp_path, trainer, damage, message):
    path = save(CheckpointDir(tmp_path, 2), trainer, 3)
    damage(path)
    with pytest.raises(CheckpointError, match=message):
        CheckpointDir(tmp_path, 2).resolve(str(path))


def test_keep_last_never_deletes_the_newest_verified_for_an_unverified_one(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep_last=1)
    for step in (3, 12):
        tmp = ckpt.staging(step)
        (tmp / "payload").write_bytes(b"good %d" % step)
        ckpt.publish(tmp, step, {})
    # keep_last=1 pruned step 3 when 12 was published; now step 12 rots, and the run (resumed from elsewhere)
    # publishes step 9: step 12 is newer but corrupt, so step 9 must survive the pruning.
    (ckpt.root / "step_000012" / "payload").write_bytes(b"rot 12")
    fresh = CheckpointDir(tmp_path, keep_last=1)
    tmp = fresh.staging(9)
    (tmp / "payload").write_bytes(b"good 9")
    fresh.publish(tmp, 9, {})
    assert [s for s, _ in fresh.complete()] == [9, 12]
    assert fresh.resolve("auto") == ckpt.root / "step_000009"
    # Once a good checkpoint is the newest, the ordinary rule applies again.
    tmp = fresh.staging(15)
    (tmp / "payload").write_bytes(b"good 15")
    fresh.publish(tmp, 15, {})
    assert [s for s, _ in fresh.complete()] == [15]


def test_planted_pickle_in_rank_state_is_refused_and_does_not_run(tmp_path, trainer):
    marker = tmp_path / "pwned"
    path = save(CheckpointDir(tmp_path, 2), trainer, 3)
    torch.save({"scheduler": Planted(marker), "rng": rng_state()}, path / "rank0.pt")
    # Through the controller's path: the changed file fails its checksum, named, before anything loads it.
    changed = r"file rank0.pt (fails its sha256 check|has \d+ bytes, \d+ were written)"  # same size or not
    with pytest.raises(CheckpointError, match=changed):
        CheckpointDir(tmp_path, 2).resolve(str(path))
    # Even with a forged manifest, loading refuses the object instead of running it.
    with pytest.raises(CheckpointError, match=r"rank0\.pt holds objects that could run code on load; refused"):
        load_trainer(trainer.model, trainer.optimizer, trainer.scheduler, path)
    assert not marker.exists()


def test_planted_pickle_in_dcp_metadata_is_refused_and_does_not_run(tmp_path, trainer):
    marker = tmp_path / "pwned"
    path = save(CheckpointDir(tmp_path, 2), trainer, 3)
    (path / "dcp" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata is not safe to load.*pathlib.Path.write_text|not allowed"):
        load_trainer(trainer.model, trainer.optimizer, trainer.scheduler, path)
    with pytest.raises(CheckpointError, match="not allowed"):
        load_model_weights(path, trainer.model)
    assert not marker.exists()


def test_planted_pickle_in_a_dcp_value_is_refused_and_does_not_run(tmp_path):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(Planted(marker), buf)
    buf.seek(0)
    planner = SafeLoadPlanner()
    planner.set_up_planner({"optim": {"lr": 0.1}}, None, True)
    idx = MetadataIndex("optim.lr")
    item = ReadItem(LoadItemType.BYTE_IO, idx, torch.Size([0]), idx, torch.Size([0]), torch.Size([0]))
    with pytest.raises(CheckpointError, match="'optim.lr' is not safe to load"):
        planner.load_bytes(item, buf)
    assert not marker.exists()
    ok = io.BytesIO()
    torch.save(0.25, ok)
    ok.seek(0)
    planner.load_bytes(item, ok)  # a plain value still loads
    assert planner.original_state_dict["optim"]["lr"] == 0.25


def test_save_load_round_trip_restores_weights_and_every_rng(tmp_path, trainer):
    ckpt = CheckpointDir(tmp_path, 2)
    random.seed(11)
    torch.manual_seed(11)
    path = save(ckpt, trainer, 3)
    expect = (random.random(), torch.rand(3))
    full = lambda t: t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach()  # noqa: E731
    before = {n: full(p).clone() for n, p in trainer.model.named_parameters()}
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.zero_()
    random.seed(99)
    torch.manual_seed(99)
    load_trainer(trainer.model, trainer.optimizer, trainer.scheduler, ckpt.resolve(str(path)))
    assert (random.random(), torch.rand(3)[0].item()) == (expect[0], expect[1][0].item())
    for n, p in trainer.model.named_parameters():
        assert torch.equal(full(p), before[n]), n
    state = read_rank_state(path / "rank0.pt")  # weights_only=True: only tensors and plain values inside
    assert isinstance(state["rng"]["torch"], torch.Tensor) and isinstance(state["scheduler"]["base_lrs"], list)


def test_older_rng_state_form_still_restores():
    random.seed(5)
    old = {"python": random.getstate(), "torch": torch.get_rng_state()}  # the tuple form written before
    want = random.random()
    set_rng_state(old)
    assert random.random() == want


def _published(tmp_path: Path, trainer, model_section: dict) -> Path:
    ckpt = CheckpointDir(tmp_path, 1)
    tmp = ckpt.staging(1)
    trainer.save(str(tmp))
    return ckpt.publish(tmp, 1, {"loader": {}, "config": {"model": model_section}})


def test_export_takes_no_model_folder_or_remote_code_from_the_checkpoint(tmp_path, trainer, tiny_path, capsys):
    from hybridrl.export import main as export_main

    path = _published(tmp_path, trainer, {"name": "hf", "path": "/elsewhere/model", "trust_remote_code": True})
    out = tmp_path / "hf"
    with pytest.raises(SystemExit, match=r"model.path='/elsewhere/model'; pass --model-path"):
        export_main(["--checkpoint", str(path), "--output", str(out)])
    with pytest.raises(SystemExit, match="sets model.trust_remote_code=true; pass --trust-remote-code"):
        export_main(["--checkpoint", str(path), "--output", str(out), "--model-path", tiny_path])
    assert not out.exists()
    # What the user passes is what runs: the folder given here, not the one in meta.json.
    assert (
        export_main(["--checkpoint", str(path), "--output", str(out), "--model-path", tiny_path, "--trust-remote-code"])
        == 0
    )
    assert (out / "config.json").is_file()


def test_export_refuses_a_corrupt_checkpoint(tmp_path, trainer, capsys):
    from hybridrl.export import main as export_main

    path = _published(tmp_path, trainer, {})
    overwrite(path / SHARD, 0, 256)
    assert export_main(["--checkpoint", str(path), "--output", str(tmp_path / "hf")]) == 2
    assert f"file {SHARD} fails its sha256 check" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
