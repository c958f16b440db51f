"""meta.json under its own checksum and agreeing with its folder on the step; save failures (a full disk inside DCP,
in our own files, in meta.json) as one error naming the checkpoint, the file and the OS error, nothing left behind."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hybridrl.checkpoints import META_SHA, CheckpointDir, CheckpointWriteError, meta_digest, read_meta, verify
from hybridrl.errors import CheckpointError


def publish(ckpt: CheckpointDir, step: int, payload: bytes = b"weights") -> Path:
    tmp = ckpt.staging(step)
    (tmp / "payload").write_bytes(payload)
    return ckpt.publish(tmp, step, {"loader": {"epoch": 0, "offset": step * 4}})


def edit_meta(path: Path, **changes) -> None:
    meta = json.loads((path / "meta.json").read_text())
    meta.update(changes)
    (path / "meta.json").write_text(json.dumps(meta, indent=1))


def test_meta_json_carries_the_sha256_of_its_own_content(tmp_path):
    path = publish(CheckpointDir(tmp_path, 2), 3)
    meta = read_meta(path)
    assert meta["format"] == 3 and meta[META_SHA] == meta_digest(meta)
    body = {k: v for k, v in meta.items() if k != META_SHA}  # recomputed by hand: canonical JSON, sorted keys
    import hashlib

    want = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert meta[META_SHA] == want
    verify(path)


def test_an_edited_step_is_refused_on_explicit_resume_and_skipped_by_auto(tmp_path, caplog):
    ckpt = CheckpointDir(tmp_path, 3)
    publish(ckpt, 2)
    edited = publish(ckpt, 4)
    edit_meta(edited, step=6)  # what the issue did: "step": 3 -> 5
    with pytest.raises(CheckpointError, match=r"step_000004: meta.json fails its sha256 check \(edited after it"):
        CheckpointDir(tmp_path, 3).resolve(str(edited))
    with caplog.at_level(logging.WARNING):
        assert CheckpointDir(tmp_path, 3).resolve("auto") == ckpt.root / "step_000002"
    assert "skipping step_000004" in caplog.text and "meta.json fails its sha256 check" in caplog.text


def test_a_step_that_disagrees_with_the_folder_is_refused_even_with_a_recomputed_checksum(tmp_path):
    path = publish(CheckpointDir(tmp_path, 2), 3)
    meta = read_meta(path)
    meta["step"] = 5
    meta[META_SHA] = meta_digest(meta)  # a careful forger
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"the folder's name says step 3, its meta.json says step 5"):
        CheckpointDir(tmp_path, 2).resolve(str(path))
    renamed = path.with_name("step_000007")
    publish(CheckpointDir(tmp_path / "b", 2), 3).rename(renamed)  # a folder renamed by hand
    with pytest.raises(CheckpointError, match=r"the folder's name says step 7, its meta.json says step 3"):
        CheckpointDir(tmp_path, 2).resolve(str(renamed))
    copied = tmp_path / "my-best"  # any other folder name makes no claim
    shutil.copytree(publish(CheckpointDir(tmp_path / "c", 2), 3), copied)
    assert CheckpointDir(tmp_path, 2).resolve(str(copied)) == copied


def test_a_removed_self_checksum_is_refused_and_format_2_still_loads(tmp_path):
    path = publish(CheckpointDir(tmp_path, 2), 3)
    meta = read_meta(path)
    del meta[META_SHA]
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="meta.json has lost its own checksum"):
        verify(path)
    meta["format"] = 2  # what hybridrl wrote before meta.json had a checksum: still resumes
    (path / "meta.json").write_text(json.dumps(meta))
    verify(path)
    edit_meta(path, step=5)  # its step is still checked against the folder
    with pytest.raises(CheckpointError, match="the folder's name says step 3, its meta.json says step 5"):
        verify(path)


# ---------------------------------------------------------------- save failures
@pytest.fixture()
def small_disk(tmp_path):
    """A folder on a 64 KiB tmpfs where this machine lets us mount one (root), else None (the tests inject the error
    at the write instead, so they run everywhere)."""
    where = tmp_path / "small"
    where.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True)
    except OSError:  # no mount program
        r = None
    if r is None or r.returncode != 0:
        yield None
        return
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def full_open(real_open=open):
    """`open` that writes to /dev/full (every write fails with ENOSPC, a real OS error) and reads normally."""

    def opener(path, mode="r", *args, **kwargs):
        return real_open("/dev/full" if any(c in mode for c in "wax") else path, mode, *args, **kwargs)

    return opener


def test_a_full_disk_inside_the_distributed_checkpoint_is_one_error_naming_the_file(
    small_disk, tmp_path, tiny_path, tokenizer, process_group, monkeypatch
):
    from tests.helpers.roles import make_actor

    trainer = make_actor(tiny_path)
    root = small_disk if small_disk is not None else tmp_path
    if small_disk is None:
        from contextlib import contextmanager

        import torch.distributed.checkpoint.filesystem as dcp_fs

        @contextmanager
        def create_stream(self, path, mode):
            with full_open()(path, mode) as stream:
                yield stream

        monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", create_stream)
    ckpt = CheckpointDir(root, 2)
    tmp = ckpt.staging(1)
    with pytest.raises(CheckpointWriteError) as e:  # an ordinary Exception now: DCP's own is a BaseException
        trainer.save(str(tmp))
    msg = str(e.value)
    assert re.match(r"checkpoint step_000001: cannot write dcp(/__0_\d+\.distcp)? \(in ", msg), msg
    assert f"(in {tmp}): No space left on device [errno 28]" in msg and "earlier checkpoints are untouched" in msg
    assert "\n" not in msg


def test_a_full_disk_in_the_rank_state_names_the_file_not_a_zip_position(tmp_path, monkeypatch):
    from hybridrl.training import checkpoint as trainer_ckpt

    monkeypatch.setattr(trainer_ckpt, "open", full_open(), raising=False)
    with pytest.raises(CheckpointWriteError) as e:
        trainer_ckpt.write_file(tmp_path / ".tmp-step_000002" / "rank0.pt", b"x" * 100, tmp_path / ".tmp-step_000002")
    assert str(e.value).startswith("checkpoint step_000002: cannot write rank0.pt (in ")
    assert "No space left on device [errno 28]" in str(e.value) and "unexpected pos" not in str(e.value)


def test_a_full_disk_at_meta_json_leaves_nothing_that_looks_complete(small_disk, tmp_path, monkeypatch):
    root = small_disk if small_disk is not None else tmp_path
    ckpt = CheckpointDir(root, 2)
    publish(ckpt, 1, b"small")
    tmp = ckpt.staging(2)
    if small_disk is not None:
        (tmp / "payload").write_bytes(b"x" * 40_000)  # fits; the manifest's meta.json then finds the disk full
        (tmp / "filler").write_bytes(b"x" * 12_000)
    else:
        (tmp / "payload").write_bytes(b"x")
        import hybridrl.checkpoints as checkpoints

        monkeypatch.setattr(checkpoints, "open", full_open(), raising=False)
    with pytest.raises(CheckpointWriteError, match=r"^checkpoint step_000002: cannot write meta.json.*No space left"):
        ckpt.publish(tmp, 2, {"loader": {}, "config": {"pad": "y" * 30_000}})
    assert not tmp.exists() and not (ckpt.root / "step_000002").exists()
    assert CheckpointDir(root, 2).resolve("auto") == ckpt.root / "step_000001"
