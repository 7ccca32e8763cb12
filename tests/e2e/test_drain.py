"""SIGTERM drains `tandem serve --http` (issue 52): /health and new requests answer 503 (with
Retry-After) at once, the requests in flight (HTTP streamed or whole, and a ZeroMQ Client's)
run to their end, then every rank exits 0. With a drain shorter than the requests
(--shutdown-timeout), each is answered (a result or an error) and the server exits soon
after the bound. Two launches of the tiny CPU pair (the unit tests of the drain's states:
tests/unit/serving/test_server_drain.py)."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest

from runtime import Client
from runtime.api.openai.errors import RETRY_AFTER_S
from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(300)

MODEL = "target"
REQUESTS = 8  # 4 streamed, 4 whole
PROBE_TOKENS = 16  # the speed probe: REQUESTS requests of this many new tokens
GOAL_S = 5.0  # how long the requests should run: long past the SIGTERM, on any host
MAX_TOKENS = 600
KEY = "sk-drain-test"  # the server is keyed, as a deployment behind a balancer is


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("drain")
    target = checkpoints.build_with_tokenizer(root / MODEL, seed=0, max_position_embeddings=1024)
    draft = checkpoints.build_near_draft(target, root / "draft", noise=0.05)
    return draft, target


@dataclass
class Call:
    """One chat request on a thread of its own: its status, headers and, streamed, the
    content tokens as they came (the usage chunk's count), else the response body."""

    url: str
    stream: bool
    max_tokens: int
    status: int | None = None
    headers: Any = None  # an email.message.Message: its get() ignores case
    body: dict | None = None
    events: list = field(default_factory=list)
    first: threading.Event = field(default_factory=threading.Event)  # a token, or the end
    done: threading.Event = field(default_factory=threading.Event)
    last_at: float = 0.0  # when the last chunk came

    def start(self) -> Call:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,  # every answer runs to max_tokens
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        request = urllib.request.Request(
            self.url + "/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=200) as resp:
                self.status, self.headers = resp.status, resp.headers
                self._read(resp)
        except urllib.error.HTTPError as exc:
            self.status, self.headers = exc.code, exc.headers
            self.body = json.loads(exc.read())
        finally:
            self.first.set()
            self.done.set()

    def _read(self, resp) -> None:
        if not self.stream:
            self.body = json.loads(resp.read())
            return
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            self.events.append(data if data == "[DONE]" else json.loads(data))
            self.last_at = time.monotonic()
            if len(self.events) >= 2:  # the role's chunk, then the first token's
                self.first.set()

    @property
    def tokens(self) -> int | None:
        """The completion tokens the response reports."""
        if not self.stream:
            return (self.body or {}).get("usage", {}).get("completion_tokens")
        usage = [e["usage"] for e in self.events if isinstance(e, dict) and e.get("usage")]
        return usage[-1]["completion_tokens"] if usage else None

    @property
    def error(self) -> dict | None:
        if not self.stream:
            return (self.body or {}).get("error")
        errors = [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]
        return errors[0] if errors else None


def _get(url: str) -> tuple[int, dict, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


class Serving:
    """`tandem serve --http` of the tiny pair, in its own process group."""

    def __init__(self, models, root, *args: str):
        cfg = launch.write_config(root / "c.yaml", *models, max_batch_size=16, max_seq_len=1024)
        self.address = f"ipc://{root}/server.sock"
        self.url = f"http://127.0.0.1:{launch.free_port()}"
        self.log = root / "serve.log"
        http = ("--http", self.url.removeprefix("http://"), "--api-key", KEY)
        self.proc = launch.start_serve(cfg, self.address, *http, *args, log_path=self.log)
        launch.wait_http(self.url, self.proc, self.log)
        self.client = Client(self.address)

    def tokens_for_goal(self) -> int:
        """New tokens that keep REQUESTS chat requests running for about GOAL_S on this host
        now (a 2-core host shared with other tests is many times slower than an idle one),
        from the time of REQUESTS such requests of PROBE_TOKENS."""
        start = time.monotonic()
        probes = [Call(self.url, i % 2 == 0, PROBE_TOKENS).start() for i in range(REQUESTS)]
        assert all(p.done.wait(120) and p.status == 200 for p in probes), "the probe failed"
        rate = PROBE_TOKENS / (time.monotonic() - start)
        return max(PROBE_TOKENS, min(MAX_TOKENS, int(rate * GOAL_S)))

    def in_flight(self, tokens: int, others: int = 0) -> list[Call]:
        """REQUESTS chat requests of `tokens` new tokens, each streamed one past its first
        token, every one running on the server (with `others` there already)."""
        calls = [Call(self.url, i % 2 == 0, tokens).start() for i in range(REQUESTS)]
        for call in calls:
            if call.stream:
                assert call.first.wait(120), "a stream did not start"
        deadline = time.monotonic() + 60
        while self._running() < REQUESTS + others:
            assert time.monotonic() < deadline, f"running: {self._running()}"
            time.sleep(0.05)
        return calls

    def _running(self) -> int:
        stats = self.client.stats()
        return stats["running"] + stats["queued"]

    def sigterm(self) -> float:
        self.proc.send_signal(signal.SIGTERM)
        return time.monotonic()

    def output(self) -> str:
        return self.log.read_text()[-4000:]

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            launch.stop(self.proc, 10)  # a failed test's server: the test said why
        launch.assert_group_gone(self.proc.pid)


@pytest.fixture
def serving(models, tmp_path):
    made: list[Serving] = []

    def start(*args: str) -> Serving:
        made.append(Serving(models, tmp_path, *args))
        return made[-1]

    yield start
    for s in made:
        s.close()


def _zmq_stream(client: Client, tokens: int, out: dict) -> None:
    try:
        deltas = client.stream(prompt_token_ids=[5, 6, 7], max_new_tokens=tokens, ignore_eos=True)
        out["tokens"] = sum(len(d.token_ids) for d in deltas)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out["error"] = exc


def _wait_503(url: str, timeout_s: float = 10.0) -> tuple[float, dict]:
    """(when /health first answered 503, its body)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, _, body = _get(url + "/health")
        if status == 503:
            return time.monotonic(), body
        assert status == 200 and time.monotonic() < deadline, (status, body)
        time.sleep(0.02)


def test_sigterm_drains_every_request_in_flight(serving):
    s = serving("--shutdown-timeout", "120")
    tokens = s.tokens_for_goal()
    zmq: dict = {}
    zmq_thread = threading.Thread(target=_zmq_stream, args=(s.client, tokens, zmq))
    zmq_thread.start()
    calls = s.in_flight(tokens, others=1)
    signalled = s.sigterm()
    unhealthy_at, health = _wait_503(s.url)
    late = Call(s.url, False, 4).start()
    assert late.done.wait(30)
    assert s.proc.wait(150) == 0, s.output()
    drained = time.monotonic()
    zmq_thread.join(30)
    assert all(call.done.wait(30) for call in calls)
    assert unhealthy_at - signalled < 5.0
    assert health["error"]["code"] == "server_draining", health
    retry = late.headers.get("Retry-After")
    assert late.status == 503 and retry == str(RETRY_AFTER_S), (late.status, late.body)
    assert late.body["error"]["code"] == "server_draining", late.body
    for call in calls:
        assert call.status == 200 and call.error is None, (call.status, call.body, call.error)
        assert call.tokens == tokens, (call.stream, call.tokens)
    # still running when the drain began: the streams went on after /health said 503
    assert all(c.last_at > unhealthy_at for c in calls if c.stream)
    assert zmq == {"tokens": tokens}, zmq
    print(f"{tokens} tokens each; drained {drained - signalled:.1f} s after SIGTERM")


def test_a_drain_shorter_than_the_requests_answers_each_and_exits(serving):
    s = serving("--shutdown-timeout", "1")
    calls = s.in_flight(s.tokens_for_goal())
    signalled = s.sigterm()
    assert s.proc.wait(60) == 0, s.output()
    took = time.monotonic() - signalled
    assert all(call.done.wait(10) for call in calls)
    assert took < 20, took
    for call in calls:
        error = call.error
        assert error is not None and "server.shutdown_timeout_s" in error["message"], error
        assert call.status == (200 if call.stream else 503), call.status  # a stream: its event
        assert call.events[-1:] == (["[DONE]"] if call.stream else [])
