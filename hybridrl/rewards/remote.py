"""`reward=remote`: scores from an HTTP endpoint (a reward model served elsewhere, a sandbox, a judge).

Each worker POSTs its shard of the batch as JSON and reads one score per item back::

    POST <reward.remote.url>   {"items": [{"prompt": ..., "response": ..., "sample": {...}, "finish_reason": ...}]}
    200                        {"scores": [0.5, 1.0, ...]}     (or a bare list; an item may be {"score": .., "x": ..})

A timeout, a refused connection, HTTP 429 or 5xx is retried `reward.remote.max_retries` times, waiting
`backoff_s`, 2 * backoff_s, ... between attempts; any other status or a body that is not the JSON above fails at
once. Every failure is one line naming the URL and the cause. Standard library only.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from typing import Any

from hybridrl.errors import HybridRLError
from hybridrl.rewards.base import RewardInput, RewardResult, normalize_results
from hybridrl.rewards.config import RemoteRewardConfig

log = logging.getLogger(__name__)


class _Retryable(Exception):
    """A failure worth another attempt (its message is the cause)."""


class RemoteReward:
    """A batched reward function (`RewardFn`) backed by an HTTP endpoint."""

    def __init__(self, cfg: RemoteRewardConfig) -> None:
        cfg.check()
        self.cfg = cfg

    def __call__(self, items: list[RewardInput]) -> list[RewardResult]:
        size = self.cfg.batch_size or max(1, len(items))
        out: list[RewardResult] = []
        for start in range(0, len(items), size):
            out.extend(self._post_with_retries(items[start : start + size]))
        return out

    def _post_with_retries(self, items: list[RewardInput]) -> list[RewardResult]:
        cfg = self.cfg
        # The conversation goes along only when there is one (rollout=agent).
        sent = [{k: v for k, v in asdict(item).items() if not (k == "messages" and v is None)} for item in items]
        body = json.dumps({"items": sent}, default=str).encode()
        for attempt in range(cfg.max_retries + 1):
            try:
                return self._post(body, len(items))
            except _Retryable as e:
                if attempt == cfg.max_retries:
                    raise HybridRLError(
                        f"reward.remote.url={cfg.url}: {e} (gave up after {attempt + 1} attempts)"
                    ) from None
                wait = cfg.backoff_s * 2**attempt
                log.warning(
                    "reward.remote.url=%s: %s; retrying in %.1f s (%d of %d)",
                    cfg.url,
                    e,
                    wait,
                    attempt + 1,
                    cfg.max_retries,
                )
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _post(self, body: bytes, n: int) -> list[RewardResult]:
        cfg = self.cfg
        headers = {"Content-Type": "application/json", "Accept": "application/json", **cfg.headers}
        request = urllib.request.Request(cfg.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=cfg.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            if e.code == 429 or e.code >= 500:
                raise _Retryable(f"HTTP {e.code} {e.reason}") from None
            raise HybridRLError(f"reward.remote.url={cfg.url}: HTTP {e.code} {e.reason} (not retried)") from None
        except (TimeoutError, socket.timeout):
            raise _Retryable(f"no answer within reward.remote.timeout_s={cfg.timeout_s}") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (TimeoutError, socket.timeout)):
                raise _Retryable(f"no answer within reward.remote.timeout_s={cfg.timeout_s}") from None
            raise _Retryable(f"cannot connect ({e.reason})") from None
        except (ConnectionError, OSError) as e:  # reset by peer, a closed connection mid-answer
            raise _Retryable(f"connection failed ({type(e).__name__}: {e})") from None
        return self._parse(raw, n)

    def _parse(self, raw: bytes, n: int) -> list[RewardResult]:
        url = self.cfg.url
        try:
            data: Any = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            snippet = raw[:60].decode("utf-8", "replace").replace("\n", " ")
            raise HybridRLError(
                f"reward.remote.url={url}: the answer is not JSON (starts with {snippet!r}); "
                'expected {"scores": [...]}'
            ) from None
        scores = data.get("scores") if isinstance(data, dict) else data
        if not isinstance(scores, list) or len(scores) != n:
            got = f"{len(scores)} scores" if isinstance(scores, list) else f"a {type(data).__name__}"
            raise HybridRLError(f'reward.remote.url={url}: expected {{"scores": [...]}} with {n} scores, got {got}')
        try:
            normalize_results(scores, expected=n)  # numbers (or dicts with "score"), finite
        except HybridRLError as e:
            raise HybridRLError(f"reward.remote.url={url}: {e}") from None
        return scores
