"""data=hf: a Hugging Face dataset from a save_to_disk folder and from the datasets cache (offline, built here as an
earlier online load_dataset would have left it), mapped to prompts like a JSONL file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.data.config import DataConfig
from hybridrl.data.prompts import load_prompts
from hybridrl.errors import ConfigError
from tests.paths import REPO

datasets = pytest.importorskip("datasets")  # the [hf] extra; the test extra brings it, so CI runs these

ROWS = [{"question": f"copy: {n}", "solution": str(n), "id": n} for n in (12, 345, 6789, 40)]


@pytest.fixture()
def saved(tmp_path) -> Path:
    folder = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])}
    ).save_to_disk(str(folder))
    return folder


def hf_cfg(path, **kw) -> DataConfig:
    return DataConfig(name="hf", path=str(path), prompt_key="question", answer_key="solution", **kw)


def test_a_save_to_disk_folder_maps_columns_like_jsonl(saved, tokenizer, tmp_path):
    train, val = load_prompts(hf_cfg(saved, val_split="test"), tokenizer)
    assert [p.sample["answer"] for p in train] == ["12", "345", "6789", "40"]
    assert [p.sample["id"] for p in val] == [12, 345]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    from_jsonl, _ = load_prompts(
        DataConfig(name="jsonl", path=str(jsonl), prompt_key="question", answer_key="solution"), tokenizer
    )
    assert [p.token_ids for p in train] == [p.token_ids for p in from_jsonl]


def test_an_unknown_split_names_the_key_and_the_splits(saved, tokenizer):
    with pytest.raises(ConfigError, match=r"data.val_split='dev' is not a split .*splits: train, test"):
        load_prompts(hf_cfg(saved, val_split="dev"), tokenizer)


def test_hf_keys_are_refused_without_data_hf():
    with pytest.raises(ConfigError, match="data.val_split is read only with data=hf"):
        DataConfig(name="synthetic", val_split="test")
    with pytest.raises(ConfigError, match="data.path is required with data=hf"):
        DataConfig(name="hf")


def build_datasets_cache(cache: Path, repo_id: str, config: str, splits: dict[str, list[dict]], scratch: Path):
    """The datasets cache as `load_dataset(repo_id, config)` leaves it: <org>___<name>/<config>/0.0.0/<hash>/."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    files = {}
    for split, rows in splits.items():
        files[split] = str(scratch / f"{split}.parquet")
        datasets.Dataset.from_list(rows).to_parquet(files[split])
    name = repo_id.split("/")[1]
    Parquet(
        cache_dir=str(cache), dataset_name=name, config_name=config, data_files=files, hash="0" * 16
    ).download_and_prepare()
    built = next((cache / name).glob(f"{config}-*"))  # the builder names the config after its data files
    target = cache / repo_id.replace("/", "___") / config
    target.parent.mkdir(parents=True)
    built.rename(target)


def test_a_hub_dataset_is_read_from_the_datasets_cache_offline(tmp_path):
    cache = tmp_path / "datasets"
    build_datasets_cache(cache, "tiny-org/copy-digits", "main", {"train": ROWS, "test": ROWS[:1]}, tmp_path)
    env = dict(os.environ, HF_DATASETS_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"))
    code = (
        "import json; from hybridrl.data.hf import read_hf_rows; "
        "print(json.dumps([read_hf_rows('tiny-org/copy-digits', 'main', s) for s in ('train', 'test')]))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    train, test = json.loads(r.stdout.strip().splitlines()[-1])
    assert train == ROWS and test == ROWS[:1]
    code = "from hybridrl.data.hf import read_hf_rows; read_hf_rows('tiny-org/elsewhere', None, 'train')"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "HF_HUB_OFFLINE=1" in r.stderr and "--repo-type dataset" in r.stderr
