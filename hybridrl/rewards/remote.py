"""`reward=remote`: scores from an HTTP endpoint (a reward model served elsewhere, a sandbox, a judge).

Each worker POSTs its shard of the batch as JSON and reads one score per item back::

    POST <reward.remote.url>   {"items": [{"prompt": ..., "response": ..., "sample": {...}, "finish_reason": ...}]}
    200                        {"scores": [0.5, 1.0, ...]}     (or a bare list; an item may be {"score": .., "x": ..})

`reward.remote.timeout_s` bounds each request as a whole: connecting, the status line and headers, and the body, to
the last byte. The request runs on a daemon thread; at the deadline its socket is shut down, which ends the thread's
wait, so a server that drips its answer a byte at a time cannot hold the run. A timeout, a refused or reset
connection, a connection closed mid-answer (`IncompleteRead`), HTTP 429 or 5xx is retried `reward.remote.max_retries`
times, waiting `backoff_s`, 2 * backoff_s, ... between attempts; any other status or a body that is not the JSON above
fails at once. Every failure is one line naming the URL and the cause (never "the reward function", and never a
fallback to one request per item). Proxies from the environment (`https_proxy`, `no_proxy`) apply, as with urllib.
Standard library only.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
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


class _Sockets:
    """The sockets one request opened (through urllib, proxies included), so another thread can cut them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: list[socket.socket] = []
        self.cut = False

    def connection_class(self, base: type) -> type:
        sockets = self

        class Tracked(base):  # type: ignore[misc, valid-type]
            def connect(self) -> None:
                super().connect()
                with sockets.lock:
                    sockets.open.append(self.sock)
                    cut = sockets.cut
                if cut:  # the deadline passed while it connected
                    _shutdown(self.sock)

        return Tracked

    def cut_all(self) -> None:
        """Shut every socket down: a thread blocked reading one returns at once (with an error, or EOF)."""
        with self.lock:
            self.cut = True
            for sock in self.open:
                _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _handlers(sockets: _Sockets) -> list[urllib.request.BaseHandler]:
    """urllib's HTTP and HTTPS handlers, opening connections whose sockets `sockets` records."""

    class HTTP(urllib.request.HTTPHandler):
        def do_open(self, http_class, req, **kwargs):  # type: ignore[no-untyped-def]
            return super().do_open(sockets.connection_class(http_class), req, **kwargs)

    class HTTPS(urllib.request.HTTPSHandler):
        def do_open(self, http_class, req, **kwargs):  # type: ignore[no-untyped-def]
            return super().do_open(sockets.connection_class(http_class), req, **kwargs)

    return [HTTP(), HTTPS()]


def _json_int(text: str) -> int:
    """A JSON integer of any length: Python refuses to convert more than 4300 digits; past that (far beyond any
    float) the magnitude is kept from the leading digits, which is all a range check needs."""
    digits = text.lstrip("-")
    if len(digits) <= 4000:
        return int(text)
    value = int(digits[:4000]) * 10 ** (len(digits) - 4000)
    return -value if text.startswith("-") else value


class RemoteReward:
    """A batched reward function (`RewardFn`) backed by an HTTP endpoint."""

    def __init__(self, cfg: RemoteRewardConfig) -> None:
        cfg.check()
        self.cfg = cfg

    def __call__(self, items: list[RewardInput]) -> list[RewardResult]:
        size = self.cfg.batch_size or max(1, len(items))
        out: list[RewardResult] = []
        for start in range(0, len(items), size):
            try:
                out.extend(self._post_with_retries(items[start : start + size]))
            except HybridRLError:
                raise
            except Exception as e:  # anything else is this client's failure, named by its URL, not a sample's
                raise HybridRLError(f"reward.remote.url={self.cfg.url}: {type(e).__name__}: {e}") from None
        return out

    def _post_with_retries(self, items: list[RewardInput]) -> list[RewardResult]:
        cfg = self.cfg
        # The conversation goes along only when there is one (rollout=agent).
        sent = [{k: v for k, v in asdict(item).items() if not (k == "messages" and v is None)} for item in items]
        body = json.dumps({"items": sent}, default=str).encode()
        for attempt in range(cfg.max_retries + 1):
            try:
                return self._parse(self._post(body), len(items))
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

    def _post(self, body: bytes) -> bytes:
        """The response body of one POST, within `timeout_s` for all of it, or _Retryable / HybridRLError."""
        cfg = self.cfg
        sockets = _Sockets()
        result: dict[str, Any] = {}

        def exchange() -> None:
            headers = {"Content-Type": "application/json", "Accept": "application/json", **cfg.headers}
            request = urllib.request.Request(cfg.url, data=body, headers=headers, method="POST")
            try:
                # Each socket operation may take the whole budget; the join below bounds their sum.
                with urllib.request.build_opener(*_handlers(sockets)).open(request, timeout=cfg.timeout_s) as r:
                    result["body"] = r.read()
            except BaseException as e:  # noqa: BLE001 - judged by the caller's thread
                result["error"] = e

        thread = threading.Thread(target=exchange, name="hybridrl-remote-reward", daemon=True)
        thread.start()
        thread.join(cfg.timeout_s)
        if thread.is_alive():
            sockets.cut_all()
            thread.join(2.0)  # the cut socket ends its read at once; a connect still under way ends within timeout_s
            raise _Retryable(
                f"no answer within reward.remote.timeout_s={cfg.timeout_s:g} s "
                "(for connecting, headers and body together)"
            )
        if "error" in result:
            raise self._classify(result["error"])
        return result["body"]

    def _classify(self, e: BaseException) -> BaseException:
        """The exception a failed exchange becomes: _Retryable (worth another attempt) or HybridRLError."""
        cfg = self.cfg
        if isinstance(e, urllib.error.HTTPError):
            if e.code == 429 or e.code >= 500:
                return _Retryable(f"HTTP {e.code} {e.reason}")
            return HybridRLError(f"reward.remote.url={cfg.url}: HTTP {e.code} {e.reason} (not retried)")
        if isinstance(e, urllib.error.URLError):
            reason = e.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                return _Retryable(f"no answer within reward.remote.timeout_s={cfg.timeout_s:g} s")
            return _Retryable(f"cannot connect ({reason})")
        if isinstance(e, (TimeoutError, socket.timeout)):
            return _Retryable(f"no answer within reward.remote.timeout_s={cfg.timeout_s:g} s")
        if isinstance(e, http.client.IncompleteRead):
            expected = f" of {e.partial.__len__() + e.expected}" if e.expected is not None else ""
            return _Retryable(f"the connection closed mid-answer (received {len(e.partial)}{expected} bytes)")
        if isinstance(e, (ConnectionError, http.client.HTTPException, OSError)):  # reset, closed, a garbled answer
            return _Retryable(f"connection failed ({type(e).__name__}: {e})")
        if isinstance(e, Exception):
            return HybridRLError(f"reward.remote.url={cfg.url}: {type(e).__name__}: {e}")
        return e  # KeyboardInterrupt and the like: as they are

    def _parse(self, raw: bytes, n: int) -> list[RewardResult]:
        url = self.cfg.url
        try:
            data: Any = json.loads(raw, parse_int=_json_int)
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
