"""Objects a config names by import path, `pkg.module:name` (your own tools, tool-call parsers, reward combiners),
loaded with errors that name the config key and say what to do."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from hybridrl.errors import ConfigError


def load_import_path(spec: str, key: str) -> Any:
    """The object `spec` ('pkg.module:name') names; ConfigError naming `key` where the module cannot be imported
    (missing, or failing inside) or has no such name."""
    module_name, sep, name = spec.partition(":")
    if not (sep and module_name and name):
        raise ConfigError(f"{key}={spec!r} is not an import path 'pkg.module:name'")
    obj = getattr(import_module(module_name, spec, key), name, None)
    if obj is None:
        raise ConfigError(f"{key}={spec!r}: {module_name!r} has no {name!r}")
    return obj


def import_module(module_name: str, spec: str, key: str) -> ModuleType:
    """The module of import path `spec`; ConfigError naming `key` where it is missing or fails inside."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(
                f"{key}={spec!r}: cannot import module {module_name!r} ({e}); make it importable: run from the "
                "directory that holds it, add that directory to PYTHONPATH, or pip install its package"
            ) from e
        raise ConfigError(f"{key}={spec!r}: importing {module_name!r} failed: {e}; install {e.name!r}") from e
    except Exception as e:  # the module itself failed: its error, not a bare traceback from deep in the build
        raise ConfigError(f"{key}={spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from e
