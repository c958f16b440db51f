"""`reward=remote` against small HTTP servers started on 127.0.0.1: answers, retries, timeouts, garbage."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.rewards.base import RewardInput
from hybridrl.rewards.config import RemoteRewardConfig, RewardConfig
from hybridrl.rewards.remote import RemoteReward

ITEMS = [RewardInput("p1", "12", {"answer": "12"}, "stop"), RewardInput("p2", "abc", {"answer": "7"}, "length")]


class Server:
    """A server on a free port of 127.0.0.1; `behave(n, body) -> (status, bytes, delay_s)` decides the n-th answer."""

    def __init__(self, behave) -> None:
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the stdlib's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"body": body, "headers": dict(self.headers)})
                status, payload, delay = behave(len(outer.requests), body)
                time.sleep(delay)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout test)

            def log_message(self, *args):  # keep the test output clean
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def serve():
    servers = []

    def start(behave) -> Server:
        servers.append(Server(behave))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def scores_by_length(body: dict) -> bytes:
    return json.dumps({"scores": [len(item["response"]) / 10 for item in body["items"]]}).encode()


def remote(url: str, **kw) -> RemoteReward:
    return RemoteReward(RemoteRewardConfig(url=url, **{"timeout_s": 5.0, "backoff_s": 0.01, **kw}))


def test_scores_come_back_for_the_items_sent(serve):
    server = serve(lambda n, body: (200, scores_by_length(body), 0))
    fn = remote(server.url, headers={"Authorization": "Bearer t"})
    assert fn(ITEMS) == [0.2, 0.3]
    sent = server.requests[0]
    assert sent["body"]["items"][1] == {
        "prompt": "p2",
        "response": "abc",
        "sample": {"answer": "7"},
        "finish_reason": "length",
    }
    assert sent["headers"]["Authorization"] == "Bearer t"


def test_batches_are_split_by_batch_size(serve):
    server = serve(lambda n, body: (200, scores_by_length(body), 0))
    assert remote(server.url, batch_size=1)(ITEMS) == [0.2, 0.3]
    assert [len(r["body"]["items"]) for r in server.requests] == [1, 1]


def test_components_pass_through(serve):
    answer = json.dumps([{"score": 1.0, "judge": 0.5}, {"score": 0.0, "judge": 0.1}]).encode()
    server = serve(lambda n, body: (200, answer, 0))
    assert remote(server.url)(ITEMS) == [{"score": 1.0, "judge": 0.5}, {"score": 0.0, "judge": 0.1}]


def test_a_server_that_fails_twice_then_answers(serve):
    server = serve(lambda n, body: (503, b"busy", 0) if n <= 2 else (200, scores_by_length(body), 0))
    assert remote(server.url, max_retries=2)(ITEMS) == [0.2, 0.3]
    assert len(server.requests) == 3


def test_retries_are_bounded(serve):
    server = serve(lambda n, body: (500, b"down", 0))
    with pytest.raises(HybridRLError) as e:
        remote(server.url, max_retries=2)(ITEMS)
    assert str(e.value) == f"reward.remote.url={server.url}: HTTP 500 Internal Server Error (gave up after 3 attempts)"
    assert len(server.requests) == 3


def test_a_server_that_times_out(serve):
    server = serve(lambda n, body: (200, scores_by_length(body), 2.0))
    t0 = time.monotonic()
    with pytest.raises(HybridRLError) as e:
        remote(server.url, timeout_s=0.2, max_retries=1)(ITEMS)
    assert time.monotonic() - t0 < 1.5  # two attempts of 0.2 s, not two of the server's 2 s
    msg = str(e.value)
    assert msg.startswith(f"reward.remote.url={server.url}: no answer within reward.remote.timeout_s=0.2")
    assert "gave up after 2 attempts" in msg and "\n" not in msg


def test_a_server_that_returns_garbage(serve):
    server = serve(lambda n, body: (200, b"<html>oops</html>", 0))
    with pytest.raises(HybridRLError, match=r"the answer is not JSON \(starts with '<html>oops</html>'\)") as e:
        remote(server.url, max_retries=3)(ITEMS)
    assert str(e.value).startswith(f"reward.remote.url={server.url}: ")
    assert len(server.requests) == 1  # garbage is not retried


@pytest.mark.parametrize(
    "payload, needle",
    [
        (b'{"scores": [1.0]}', 'expected {"scores": [...]} with 2 scores, got 1 scores'),
        (b'{"result": 1}', 'expected {"scores": [...]} with 2 scores, got a dict'),
        (
            b'{"scores": [1.0, "high"]}',
            "reward function: result 1: 'score' is 'high' (a str), not a real number; return a float",
        ),
    ],
)
def test_answers_of_the_wrong_shape(serve, payload, needle):
    server = serve(lambda n, body: (200, payload, 0))
    with pytest.raises(HybridRLError) as e:
        remote(server.url)(ITEMS)
    assert str(e.value) == f"reward.remote.url={server.url}: {needle}"


def test_a_client_error_is_not_retried(serve):
    server = serve(lambda n, body: (404, b"no such route", 0))
    with pytest.raises(HybridRLError, match="HTTP 404 Not Found \\(not retried\\)"):
        remote(server.url, max_retries=3)(ITEMS)
    assert len(server.requests) == 1


def test_nobody_listening():
    with socket.socket() as s:  # a port that was free a moment ago, with nothing on it now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    with pytest.raises(HybridRLError, match=rf"reward.remote.url={url}: cannot connect .* \(gave up after 2 attempts"):
        remote(url, max_retries=1)(ITEMS)


@pytest.mark.parametrize(
    "kw, key",
    [
        ({}, "reward.remote.url"),
        ({"url": "ftp://x"}, "reward.remote.url"),
        ({"url": "http://x", "timeout_s": 0}, "reward.remote.timeout_s"),
        ({"url": "http://x", "max_retries": -1}, "reward.remote.max_retries"),
    ],
)
def test_bad_remote_config_names_the_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        RewardConfig(name="remote", remote=RemoteRewardConfig(**kw))
    RewardConfig(name="math", remote=RemoteRewardConfig(**kw))  # not used, not checked
