"""Hub ids as model.path, offline: a huggingface_hub cache laid out here from the tiny model, as `hf download` would
leave it (models--<org>--<name>/snapshots/<commit>/..., refs/main naming the commit)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.errors import ConfigError
from hybridrl.models import hub
from hybridrl.models.loading import load_tokenizer, resolve_path
from tests.paths import REPO

REPO_ID = "tiny-org/tiny-qwen2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def build_hub_cache(cache: Path, model_folder: str, repo_id: str = REPO_ID) -> Path:
    """`cache` holding `model_folder`'s files as the snapshot of `repo_id` at COMMIT; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model_folder, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture()
def offline_cache(tmp_path, tiny_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snapshot = build_hub_cache(cache, tiny_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.hub_snapshot.cache_clear()
    yield snapshot
    hub.hub_snapshot.cache_clear()


@pytest.mark.parametrize(
    "text, is_id",
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("meta-llama/Llama-3.2-1B", True),
        ("/models/Qwen2.5", False),
        ("./models/qwen", False),
        ("~/models/qwen", False),
        ("models/qwen/extra", False),
        ("qwen", False),
        ("../qwen", False),
    ],
)
def test_what_counts_as_a_hub_id(text, is_id):
    assert hub.looks_like_hub_id(text) is is_id


def test_the_download_command_exists_in_this_environment():
    program = hub.hub_command("download").split()[0]
    assert shutil.which(program, path=os.path.dirname(sys.executable)) or shutil.which(program), program


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(offline_cache):
    folder = resolve_path(REPO_ID)
    assert Path(folder) == offline_cache
    tok = load_tokenizer(folder)
    assert tok("copy: 12")["input_ids"]


def test_an_id_missing_from_the_cache_offline_says_how_to_fetch_it(offline_cache):
    with pytest.raises(ConfigError) as e:
        resolve_path("tiny-org/not-there")
    text = str(e.value)
    assert "model.path='tiny-org/not-there' is not in the Hugging Face cache" in text
    assert f"`{hub.hub_command('download')} tiny-org/not-there`" in text and "HF_HUB_OFFLINE=1" in text


def test_a_folder_without_config_and_a_checkpoint_are_told_apart(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a Hugging Face model folder"):
        resolve_path(str(tmp_path / "empty"))
    ckpt = tmp_path / "checkpoints" / "step_000010"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text("{}")
    with pytest.raises(ConfigError, match="is a hybridrl checkpoint.*python -m hybridrl.evaluate"):
        resolve_path(str(ckpt))
    with pytest.raises(ConfigError, match="no such folder"):
        resolve_path(str(tmp_path / "missing"))


def test_generate_runs_a_hub_id_from_a_built_cache_with_hf_hub_offline(tmp_path, tiny_path):
    """End to end in a subprocess, with the environment a user sets: HF_HUB_CACHE and HF_HUB_OFFLINE=1."""
    cache = tmp_path / "hub"
    build_hub_cache(cache, tiny_path)
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridrl.generate",
            f"model.path={REPO_ID}",
            "prompts=[copy 12]",
            "engine.max_new_tokens=4",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "prompt 0: copy 12" in r.stderr + r.stdout and "[0] " in r.stderr + r.stdout
