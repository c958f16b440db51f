"""Hugging Face Hub ids where a model folder is expected (`model.path=Qwen/Qwen2.5-0.5B-Instruct`).

The id resolves to a snapshot folder in huggingface_hub's cache (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub):
downloaded on first use when online, read from the cache alone when `HF_HUB_OFFLINE=1`. Only what a causal LM
loads is fetched: config, tokenizer and chat-template files, and the safetensors weights (a repository without
safetensors falls back to its PyTorch `.bin` files). Errors name the command of the installed huggingface_hub
(`hf download`, or `huggingface-cli download` before 0.34).
"""

from __future__ import annotations

import logging
import re
from functools import lru_cache
from pathlib import Path

from hybridrl.errors import ConfigError

log = logging.getLogger("hybridrl")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py")
"""What a causal LM and its tokenizer load (remote-code .py files run only with model.trust_remote_code)."""
FALLBACK_WEIGHTS = ("*.bin",)
"""Weights of a repository that has no safetensors."""


def looks_like_hub_id(path: str) -> bool:
    """`org/name` with no leading `/`, `.` or `~` and nothing more: a Hub repository id, not a relative folder."""
    return bool(_HUB_ID.match(path)) and ".." not in path


def hub_command(action: str) -> str:
    """The installed huggingface_hub's CLI for `action` ("download", "login"): `hf ...` from 0.34 on."""
    import huggingface_hub

    major, minor = (int(x) for x in re.findall(r"\d+", huggingface_hub.__version__)[:2])
    if (major, minor) >= (0, 34):
        return {"login": "hf auth login"}.get(action, f"hf {action}")
    return f"huggingface-cli {action}"


def offline() -> bool:
    """Whether huggingface_hub may not reach the network (HF_HUB_OFFLINE=1)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


@lru_cache(maxsize=None)
def hub_snapshot(repo_id: str, key: str = "model.path") -> str:
    """The local snapshot folder of model `repo_id` (downloaded now if online and not cached yet).

    Raises ConfigError naming `key`, the id and what to do when the id is unknown, gated, or not cached offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{key}={repo_id!r}"
    local_only = offline()
    try:
        if not local_only:
            log.info("%s: fetching %s from the Hugging Face Hub into %s", key, repo_id, constants.HF_HUB_CACHE)
        folder = snapshot_download(repo_id, allow_patterns=list(MODEL_FILES), local_files_only=local_only)
        if not any(Path(folder).glob("*.safetensors")):
            folder = snapshot_download(
                repo_id, allow_patterns=list(MODEL_FILES + FALLBACK_WEIGHTS), local_files_only=local_only
            )
    except LocalEntryNotFoundError:
        raise ConfigError(
            f"{where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 allows no "
            f"download; run `{hub_command('download')} {repo_id}` where there is network (same HF_HUB_CACHE), or "
            "give model.path a local model folder"
        ) from None
    except GatedRepoError:
        raise ConfigError(
            f"{where} is gated: accept its terms on https://huggingface.co/{repo_id} and log in with "
            f"`{hub_command('login')}` (or set HF_TOKEN)"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ConfigError(
            f"{where}: no such model on the Hugging Face Hub (a private one needs `{hub_command('login')}`); "
            "a local folder must exist"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{where}: download from the Hugging Face Hub failed ({first}); with no network, fetch it elsewhere "
            f"with `{hub_command('download')} {repo_id}` and set HF_HUB_OFFLINE=1"
        ) from None
    if not (Path(folder) / "config.json").is_file():
        raise ConfigError(f"{where}: the Hub repository has no config.json; it is not a Hugging Face model")
    return folder
