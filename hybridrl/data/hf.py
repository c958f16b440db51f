"""Rows of a Hugging Face dataset (`data=hf data.path=openai/gsm8k data.config=main data.split=train`).

`data.path` is what `datasets.load_dataset` takes as its path: a Hub dataset id (downloaded into the datasets cache
when online, read from that cache with `HF_HUB_OFFLINE=1`), or a local folder: one written by `save_to_disk`
(read with `load_from_disk`), or data files (`hf download ID --repo-type dataset --local-dir FOLDER` makes one).
The rows then go through the same column mapping as a JSONL file (`data.prompt_key`, `data.answer_key`).
"""

from __future__ import annotations

import os
from pathlib import Path

from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.models.hub import hub_command, offline

SAVED_MARKERS = ("dataset_dict.json", "state.json")
"""Files `save_to_disk` writes at the top of its folder (a DatasetDict, a Dataset)."""


def _datasets():
    try:
        import datasets
    except ImportError:
        raise HybridRLError(
            "data=hf reads Hugging Face datasets with the `datasets` package, which is not installed: "
            "pip install 'hybridrl[hf]' (or pip install datasets)"
        ) from None
    return datasets


def read_hf_rows(path: str, config: str | None, split: str, key: str = "data.split") -> list[dict]:
    """The rows of `split` of dataset `path` (config `config`) as dicts; errors name the key to change."""
    datasets = _datasets()
    local = Path(os.path.expanduser(path))
    where = f"data.path={path!r}" + (f" (data.config={config!r})" if config else "")
    if any((local / m).is_file() for m in SAVED_MARKERS):
        data = datasets.load_from_disk(str(local))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ConfigError(f"{key}={split!r} is not a split of {where}; splits: {', '.join(data)}")
            data = data[split]
        rows = data.to_list()
    else:
        rows = _load(datasets, path, config, split, where, key)
    if not rows:
        raise HybridRLError(f"{where}: split {split!r} has no rows")
    return rows


def _load(datasets, path: str, config: str | None, split: str, where: str, key: str) -> list[dict]:
    """`load_dataset` with its failures turned into one line that says what to do."""
    try:
        return datasets.load_dataset(path, config, split=split).to_list()
    except ValueError as e:
        text = str(e)
        if "split" in text.lower():
            raise ConfigError(f"{key}={split!r}: {_first_line(text)} ({where})") from None
        if "config" in text.lower():
            raise ConfigError(f"data.config={config!r}: {_first_line(text)} ({where})") from None
        raise HybridRLError(f"{where}: {_first_line(text)}") from None
    except (ConnectionError, FileNotFoundError) as e:
        if offline():
            hint = (
                "HF_HUB_OFFLINE=1 reads only datasets loaded once before with network; fetch its files where "
                f"there is network with `{hub_command('download')} {path} --repo-type dataset --local-dir FOLDER` "
                "and set data.path=FOLDER, or give a save_to_disk folder"
            )
        else:
            hint = "give a Hub dataset id (such as openai/gsm8k), a save_to_disk folder or a folder of data files"
        raise HybridRLError(f"{where} cannot be loaded ({_first_line(str(e))}); {hint}") from None


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else "no message"
