"""`pkg.module:name` config values: the object, or an error naming the key and what went wrong."""

from __future__ import annotations

import pytest

from hybridrl.errors import ConfigError
from hybridrl.import_path import load_import_path


def test_the_object_it_names():
    import json

    assert load_import_path("json:dumps", "k") is json.dumps


@pytest.mark.parametrize(
    "spec, message",
    [
        ("json.dumps", "k='json.dumps' is not an import path 'pkg.module:name'"),
        ("no_such_pkg_q.mod:f", "k='no_such_pkg_q.mod:f': cannot import module 'no_such_pkg_q.mod'"),
        ("json:no_such_name", "k='json:no_such_name': 'json' has no 'no_such_name'"),
        ("needs_missing_q:f", "importing 'needs_missing_q' failed: .*install 'no_such_dependency_q'"),
        ("raises_q:f", "importing 'raises_q' raised ValueError: at import"),
    ],
)
def test_errors_name_the_key(spec, message, tmp_path, monkeypatch):
    # Modules that exist but fail: the missing dependency, or the module's own error, is named.
    (tmp_path / "needs_missing_q.py").write_text("import no_such_dependency_q\n")
    (tmp_path / "raises_q.py").write_text("raise ValueError('at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=message):
        load_import_path(spec, "k")
