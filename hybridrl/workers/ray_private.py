"""A private Ray for one run (`cluster=ray` without `cluster.ray_address`): started and stopped with the run, every
file it writes kept in one temporary folder of the run and removed at the end (its logs kept when the run failed),
never in /tmp/ray or the home folder.

Recent Ray turns token authentication on for a cluster that `ray.init` starts, and writes a new token to
~/.ray/auth_token for it. Here the token is written into the run's folder instead (mode 0600) and named by
RAY_AUTH_TOKEN_PATH, which the cluster's processes inherit; a user who set RAY_AUTH_MODE or RAY_AUTH_TOKEN keeps
what they chose.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile

log = logging.getLogger("hybridrl")

AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")
# One token per process: Ray's token loader keeps the first token it read, and a sweep starts a Ray per run.
_TOKEN = secrets.token_hex(32)
# Ray's socket paths (<temp>/session_<date>_<pid>/sockets/...) must stay under ~107 bytes.
_MAX_BASE_CHARS = 40


def short_temp_base() -> str:
    """Where the run's Ray folder goes: the temporary folder ($TMPDIR) when its path is short enough, else /tmp."""
    base = tempfile.gettempdir()
    return base if len(base) <= _MAX_BASE_CHARS else "/tmp"


def _refresh_ray_config() -> None:
    """Make an already imported Ray see the variables set here, as Ray itself does when it turns token auth on."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # another Ray version: it reads the variables when the cluster starts
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


class PrivateRay:
    """Start a local Ray whose files all live in one folder of ours; `stop` removes them."""

    def __init__(self, ray) -> None:
        self.ray = ray
        self.temp_dir: str | None = None
        self._env_before: dict[str, str | None] = {}

    def start(self, num_cpus: int) -> None:
        """`ray.init` of a new local cluster with `num_cpus` CPUs, no dashboard, token in our folder."""
        self.temp_dir = tempfile.mkdtemp(prefix="hybridrl-ray-", dir=short_temp_base())  # mode 0700
        self._env_before = {k: os.environ.get(k) for k in AUTH_VARS}
        if os.environ.get("RAY_AUTH_MODE", "token") == "token" and not os.environ.get("RAY_AUTH_TOKEN"):
            path = os.path.join(self.temp_dir, "auth_token")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(_TOKEN)
            os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=path)
            _refresh_ray_config()
        self.ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            _temp_dir=self.temp_dir,
            log_to_driver=True,
        )

    def stop(self, keep_logs: bool) -> None:
        """Shut Ray down; remove its folder (all but its logs when `keep_logs`, the token always); restore the
        variables set at start."""
        self.ray.shutdown()
        if self.temp_dir is not None:
            token = os.path.join(self.temp_dir, "auth_token")
            if os.path.exists(token):
                os.remove(token)
            if keep_logs:
                log.info("Ray's logs are kept in %s", self.temp_dir)
            else:
                shutil.rmtree(self.temp_dir, ignore_errors=True)
        for key, value in self._env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._env_before = {}
