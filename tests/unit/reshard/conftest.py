"""Fixtures of the resharding tests."""


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated here so this folder runs on its own.
    config.addinivalue_line("markers", "multiproc: spawns several worker processes (CI runs them as their own step)")
