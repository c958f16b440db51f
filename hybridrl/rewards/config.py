"""The `reward:` config group: which reward function scores the rollouts.

    reward=math                              # a registered name (see hybridrl.rewards.registered_rewards())
    reward.fn=my_pkg.my_rewards:exact_match  # your own function; overrides reward.name

The controller resolves it once: `fn = resolve_reward(cfg.fn or cfg.name)`.
`__post_init__` checks the form of the values; it runs when the composed config is turned into objects
(`OmegaConf.to_object`). Whether a name is registered is checked by `resolve_reward`, after the modules that
register rewards are imported.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

from hybridrl.errors import ConfigError

_FN_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@dataclass
class RemoteRewardConfig:
    """The endpoint `reward=remote` posts to (`reward.remote.*`)."""

    url: Optional[str] = None
    """http(s) URL that takes the JSON batch; required with reward=remote."""
    timeout_s: float = 60.0
    """Seconds one request may take, all of it (connecting, the headers and the whole body), before it counts as
    failed (and is retried)."""
    max_retries: int = 3
    """Further attempts after a failed one (timeouts, refused connections, HTTP 429/5xx); 0 = no retry."""
    backoff_s: float = 1.0
    """Wait before the first retry; doubled before each next one."""
    batch_size: int = 0
    """Items per request; 0 = this worker's whole shard in one request."""
    headers: dict[str, str] = field(default_factory=dict)
    """Extra HTTP headers (e.g. Authorization)."""

    def check(self) -> None:
        """ConfigError naming `reward.remote.<key>` for a bad value (the caller knows whether a URL is needed)."""
        if not self.url or not self.url.startswith(("http://", "https://")):
            raise ConfigError(
                f"reward.remote.url must be an http:// or https:// URL with reward=remote, got {self.url!r}"
            )
        if not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ConfigError(f"reward.remote.timeout_s must be a finite number > 0, got {self.timeout_s}")
        if self.max_retries < 0:
            raise ConfigError(f"reward.remote.max_retries must be >= 0, got {self.max_retries}")
        if self.backoff_s < 0:
            raise ConfigError(f"reward.remote.backoff_s must be >= 0, got {self.backoff_s}")
        if self.batch_size < 0:
            raise ConfigError(f"reward.remote.batch_size must be >= 0, got {self.batch_size}")


@dataclass
class RewardConfig:
    """Reward selection."""

    # Optional[...] rather than `str | None`: OmegaConf resolves these annotations itself.
    name: str = "synthetic"
    """A registered reward: "synthetic" (the default task), "math", "format", "math_with_format", ..."""
    fn: Optional[str] = None
    """A custom reward "pkg.module:func" (see hybridrl.rewards.registry); every worker imports it, running its code."""
    error_score: float = 0.0
    """Reward of a sample on which the reward function raised (counted in reward/errors)."""
    max_error_frac: float = 0.25
    """Stop the run when the reward function raises on more than this fraction of a batch (0 = on any error)."""
    timeout_s: float = 300.0
    """Wall-clock bound of one worker's reward function calls on a batch; samples with no result by then score
    error_score and count in reward/errors (hybridrl/rewards/deadline.py says what happens to the late calls)."""
    num_workers: int = 8
    """Threads a per-sample reward function runs on, one sample per call (1 = one sample at a time); a per-sample
    function must then be safe to call from several threads."""
    weight: float = 1.0
    """Weight of this reward function's score in combine=sum (beside the reward models' weights)."""
    combine: str = "sum"
    """How the function's and the reward models' scores become one: sum (weighted) or "pkg.module:func" taking
    {source: [scores]} (hybridrl.rewards.combine)."""
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    """The endpoint of reward=remote (hybridrl.rewards.remote)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError("reward.name is empty; set it to a registered reward name, e.g. reward.name=math")
        if ":" in self.name:
            raise ConfigError(
                f"reward.name={self.name!r} looks like a function path; set reward.fn={self.name} instead"
            )
        if self.fn is not None and not _FN_RE.match(self.fn.strip()):
            raise ConfigError(
                f"reward.fn={self.fn!r} is not of the form 'pkg.module:func' (a dotted module path, one colon, "
                "a function name), e.g. reward.fn=my_rewards:exact_match"
            )
        if not math.isfinite(self.error_score):
            raise ConfigError(f"reward.error_score must be a finite number, got {self.error_score}")
        if not 0.0 <= self.max_error_frac <= 1.0:
            raise ConfigError(f"reward.max_error_frac must be in [0, 1], got {self.max_error_frac}")
        if not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ConfigError(f"reward.timeout_s must be a finite number of seconds > 0, got {self.timeout_s}")
        if self.num_workers < 1:
            raise ConfigError(f"reward.num_workers must be >= 1, got {self.num_workers}")
        if self.name == "remote" and not self.fn:
            self.remote.check()
        if not isinstance(self.combine, str) or not self.combine.strip():
            raise ConfigError("reward.combine is empty; use sum or 'pkg.module:func'")

    @property
    def spec(self) -> str:
        """What to pass to `resolve_reward`: `fn` when set, else `name`."""
        return self.fn.strip() if self.fn else self.name.strip()
