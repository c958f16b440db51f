"""Deadlines on everything a reward waits for: a remote server that drips its answer or closes mid-answer, a
per-sample function that is slow on some samples or all, a batched one that never returns, huge integer scores."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

from hybridrl.errors import HybridRLError
from hybridrl.rewards import RewardInput, batched, per_sample
from hybridrl.rewards.base import score_rewards
from hybridrl.rewards.config import RemoteRewardConfig, RewardConfig
from hybridrl.rewards.deadline import MAX_STUCK_PER_WORKER, call_with_deadline, stuck_calls
from hybridrl.rewards.remote import RemoteReward

ITEMS = [RewardInput("p1", "12", {"answer": "12"}, "stop"), RewardInput("p2", "abc", {"answer": "7"}, "length")]


def items(*responses: str) -> list[RewardInput]:
    return [RewardInput(prompt=f"Q{i}", response=r, sample={"id": i}) for i, r in enumerate(responses)]


class RawServer:
    """A TCP server on 127.0.0.1 that reads one HTTP request per connection and answers with `answer(conn, n)`."""

    def __init__(self, answer) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/score"
        self.connections = 0
        self.stop = threading.Event()

        def serve() -> None:
            while not self.stop.is_set():
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                self.connections += 1
                threading.Thread(target=self._one, args=(conn, self.connections, answer), daemon=True).start()

        threading.Thread(target=serve, daemon=True).start()

    def _one(self, conn: socket.socket, n: int, answer) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(
            next(v for k, v in (ln.split(b":", 1) for ln in head.split(b"\r\n")[1:]) if k.lower() == b"content-length")
        )
        while len(body) < length:
            body += conn.recv(65536)
        try:
            answer(conn, n, json.loads(body), self.stop)
        except OSError:
            pass  # the client cut the connection: what a deadline does
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def ok(body: dict) -> bytes:
    payload = json.dumps({"scores": [0.5] * len(body["items"])}).encode()
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(payload),
        payload,
    )


def drip(data: bytes, every_s: float, stop: threading.Event, conn: socket.socket) -> None:
    for i in range(len(data)):
        if stop.wait(every_s):
            return
        conn.sendall(data[i : i + 1])


@pytest.fixture()
def raw():
    servers = []

    def start(answer) -> RawServer:
        servers.append(RawServer(answer))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def remote(url: str, **kw) -> RemoteReward:
    return RemoteReward(RemoteRewardConfig(url=url, **{"timeout_s": 1.0, "max_retries": 1, "backoff_s": 0.0, **kw}))


@pytest.mark.parametrize("part", ["body", "headers"])
def test_a_server_that_drips_its_answer_is_cut_at_the_whole_request_deadline(raw, part):
    """One byte every 0.2 s never trips a per-read timeout of 1 s; the whole request's deadline of 1 s ends it."""

    def answer(conn, n, body, stop):
        whole = ok(body)
        cut = whole.index(b"\r\n\r\n") + 4
        if part == "body":
            conn.sendall(whole[:cut])
            drip(whole[cut:], 0.2, stop, conn)
        else:
            drip(whole, 0.2, stop, conn)

    server = raw(answer)
    t0 = time.monotonic()
    with pytest.raises(HybridRLError) as e:
        remote(server.url)(ITEMS)
    took = time.monotonic() - t0
    assert took < 4.0, took  # two attempts of 1 s (plus the cut), not the ~20 s the drip takes
    assert str(e.value) == (
        f"reward.remote.url={server.url}: no answer within reward.remote.timeout_s=1 s (for connecting, headers "
        "and body together) (gave up after 2 attempts)"
    )
    assert server.connections == 2


def test_a_connection_closed_mid_answer_is_retried_then_named(raw):
    def answer(conn, n, body, stop):
        whole = ok(body)
        conn.sendall(whole if n == 2 else whole[: len(whole) - 5])  # the first answer is cut short

    server = raw(answer)
    assert remote(server.url)(ITEMS) == [0.5, 0.5]  # the second attempt succeeds
    assert server.connections == 2

    closing = raw(lambda conn, n, body, stop: conn.sendall(ok(body)[:-5]))
    with pytest.raises(HybridRLError) as e:
        remote(closing.url)(ITEMS)
    msg = str(e.value)
    assert msg.startswith(f"reward.remote.url={closing.url}: the connection closed mid-answer (received ")
    assert msg.endswith("(gave up after 2 attempts)") and "reward function" not in msg


def test_a_remote_failure_is_not_retried_per_sample_through_the_reward_function(raw):
    closing = raw(lambda conn, n, body, stop: conn.sendall(ok(body)[:-5]))
    fn = remote(closing.url)
    with pytest.raises(HybridRLError, match="the connection closed mid-answer"):
        score_rewards(fn, ITEMS * 8, RewardConfig(max_error_frac=1.0))
    assert closing.connections == 2  # one batch request and its retry, not 16 one-item requests


def test_a_huge_integer_score_is_reported_as_out_of_range_not_as_bad_json(raw):
    digits = "9" * 5000

    def answer(conn, n, body, stop):
        payload = b'{"scores": [0.5, ' + digits.encode() + b"]}"
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))

    server = raw(answer)
    with pytest.raises(HybridRLError) as e:
        remote(server.url)(ITEMS)
    msg = str(e.value)
    assert "not JSON" not in msg
    assert "result 1: 'score' is an integer of 5000 digits, beyond float32's range" in msg


def test_a_huge_integer_from_a_local_function_is_named_too():
    with pytest.raises(HybridRLError, match=r"'score' is an integer of 40 digits, beyond float32's range"):
        score_rewards(batched(lambda xs: [10**39 for _ in xs]), items("a"), RewardConfig())
    out = score_rewards(batched(lambda xs: [10**38 for _ in xs]), items("a"), RewardConfig())  # within float32
    assert out.scores == [1e38]


@per_sample
def slow_on_some(item: RewardInput) -> float:
    if item.response.startswith("slow"):
        time.sleep(30)
    return 1.0


def test_one_slow_sample_costs_one_score_not_the_step(caplog):
    cfg = RewardConfig(timeout_s=0.5, error_score=-1.0, max_error_frac=0.5)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        out = score_rewards(slow_on_some, items("a", "slow b", "c", "d"), cfg, name="m:slow_on_some")
    assert time.monotonic() - t0 < 2.0
    assert out.scores == [1.0, -1.0, 1.0, 1.0] and out.errors == 1
    assert (
        "reward function m:slow_on_some did not return within reward.timeout_s=0.5 s on 1 of 4 samples; first: "
        "RewardTimeout: no result within reward.timeout_s=0.5 s; on response='slow b'" in caplog.text
    )


def test_a_function_slow_on_every_sample_stops_the_run_within_the_deadline():
    @per_sample
    def slow(item: RewardInput) -> float:
        time.sleep(30)
        return 1.0

    t0 = time.monotonic()
    with pytest.raises(HybridRLError) as e:
        score_rewards(slow, items(*"abcdefgh"), RewardConfig(timeout_s=0.5, num_workers=2), name="m:slow")
    assert time.monotonic() - t0 < 2.0  # 8 samples on 2 threads would take 120 s one after another
    msg = str(e.value)
    assert msg.startswith("reward function m:slow did not return within reward.timeout_s=0.5 s on 8 of 8 samples")
    assert msg.endswith("That is more than reward.max_error_frac=0.25: fix the function")


def test_a_batched_call_that_never_returns_fails_the_whole_batch():
    @batched
    def hangs(batch: list[RewardInput]) -> list[float]:
        time.sleep(30)
        return [1.0] * len(batch)

    out = score_rewards(hangs, items("a", "b"), RewardConfig(timeout_s=0.3, max_error_frac=1.0, error_score=-2.0))
    assert out.scores == [-2.0, -2.0] and out.errors == 2
    with pytest.raises(HybridRLError, match=r"did not return within reward.timeout_s=0.3 s on 2 of 2 samples"):
        score_rewards(hangs, items("a", "b"), RewardConfig(timeout_s=0.3))


def test_raised_and_late_samples_are_counted_together(caplog):
    @per_sample
    def mixed(item: RewardInput) -> float:
        if item.response == "boom":
            raise ValueError("cannot parse")
        if item.response == "slow":
            time.sleep(30)
        return 0.5

    with caplog.at_level(logging.WARNING):
        out = score_rewards(mixed, items("boom", "slow", "ok", "ok"), RewardConfig(timeout_s=0.5, max_error_frac=0.5))
    assert out.scores == [0.0, 0.0, 0.5, 0.5] and out.errors == 2
    assert "raised on 1 and did not return within reward.timeout_s=0.5 s on 1 of 4 samples; first: ValueError" in (
        caplog.text
    )


def test_calls_that_hang_for_good_stop_the_run_once_they_pile_up():
    release = threading.Event()
    try:
        for k in range(MAX_STUCK_PER_WORKER):  # batches of 3 calls on 1 thread: each leaves that thread stuck
            outcomes = call_with_deadline(lambda: release.wait(60), [()] * 3, 1, 0.05, "m:hang")
            assert [o.late for o in outcomes] == [True] * 3
            assert stuck_calls("m:hang") == k + 1
        with pytest.raises(HybridRLError) as e:
            call_with_deadline(lambda: None, [()], 1, 0.05, "m:hang")
        assert str(e.value).startswith(
            f"reward function m:hang: {MAX_STUCK_PER_WORKER} calls from earlier batches are still running long past "
            "reward.timeout_s=0.05 s; it hangs on some inputs"
        )
        assert call_with_deadline(lambda: 7, [()], 1, 0.05, "m:other")[0].value == 7  # another function is not blamed
    finally:
        release.set()
