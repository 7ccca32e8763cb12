"""`tandem serve` whose steps outlast every liveness threshold: its workers are stopped
(SIGSTOP) for longer than the server's client timeout and the client's silence limit, as a
long prefill on a busy machine holds a step; every request still completes. And a taken
server.address is a usage error before any worker loads."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import yaml

from runtime import Client
from tests import launch
from tests.processes import descendants

pytestmark = pytest.mark.timeout(300)

STALL_S = 4.0  # longer than client_timeout_s (1 s) and the Client's dead_after_s (2 s)


@pytest.fixture(scope="module")
def served(tokenized_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("slow")
    cfg = launch.write_config(root / "c.yaml", *tokenized_pair, max_seq_len=256)
    config = yaml.safe_load(open(cfg))
    config["server"] = {"client_timeout_s": 1.0}
    open(cfg, "w").write(yaml.safe_dump(config))
    address, port = f"ipc://{root}/server.sock", launch.free_port()
    log = root / "serve.log"
    proc = launch.start_serve(cfg, address, "--http", f"127.0.0.1:{port}", log_path=log)
    try:
        launch.wait_http(f"http://127.0.0.1:{port}", proc, log)
        yield {"proc": proc, "address": address, "url": f"http://127.0.0.1:{port}/v1", "log": log}
    finally:
        launch.stop(proc)
        launch.assert_group_gone(proc.pid)


def stall_workers(proc: subprocess.Popen, seconds: float) -> None:
    """Stop every worker for `seconds`: the step in flight lasts at least that long."""
    workers = descendants(proc.pid)
    for pid in workers:
        subprocess.run(["kill", "-STOP", str(pid)], check=False)
    time.sleep(seconds)
    for pid in workers:
        subprocess.run(["kill", "-CONT", str(pid)], check=False)


def http_completion(url: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps(
        {"model": "target", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    ).encode()
    req = urllib.request.Request(url + "/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_requests_outlive_a_stalled_step(served):
    """Python client (streamed and not) and HTTP client all get their whole answer, though
    a step in the middle of their requests lasts STALL_S."""
    prompt, n = "Once upon a time", 120
    with Client(served["address"], dead_after_s=2.0, ping_s=0.2) as client:
        want = client.generate(prompt, max_new_tokens=n).token_ids
        results: dict = {}
        first = threading.Event()

        def streamed():
            tokens = []
            for delta in client.stream(prompt, max_new_tokens=n):
                tokens += delta.token_ids
                first.set()
            return tokens

        def run(name, call):
            try:
                results[name] = call()
            except BaseException as exc:  # noqa: BLE001 - asserted below
                results[name] = exc
            first.set()

        calls = {
            "stream": streamed,
            "generate": lambda: client.generate(prompt, max_new_tokens=n).token_ids,
            "http": lambda: http_completion(served["url"], prompt, n),
        }
        threads = [threading.Thread(target=run, args=item) for item in calls.items()]
        for t in threads:
            t.start()
        assert first.wait(60)
        stall_workers(served["proc"], STALL_S)
        for t in threads:
            t.join(120)
        assert results["stream"] == want, results
        assert results["generate"] == want, results
        http = results["http"]
        assert isinstance(http, dict) and http["usage"]["completion_tokens"] == len(want), http
        assert client.info()["max_seq_len"] == 256  # still alive, not judged dead
    assert "cancelling request" not in open(served["log"]).read()


@pytest.mark.parametrize("flag", [None, "--address"])
def test_a_taken_server_address_is_a_usage_error(tokenized_pair, tmp_path, flag):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        cfg = launch.write_config(tmp_path / "c.yaml", *tokenized_pair)
        config = yaml.safe_load(open(cfg))
        args = ["--address", address] if flag else []
        if not flag:
            config["server"] = {"address": address}
        open(cfg, "w").write(yaml.safe_dump(config))
        start = time.monotonic()
        res = subprocess.run(
            [sys.executable, "-m", "launcher", "serve", cfg, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(launch.clean_env(), TANDEM_LAUNCH="spawn"),
        )
        took = time.monotonic() - start
    assert res.returncode == 2, res.stderr[-2000:]
    name = flag or "server.address"
    assert f"tandem: error: {name}: cannot listen on {address}" in res.stderr, res.stderr
    assert "Address already in use" in res.stderr
    assert "ready:" not in res.stderr and "loading" not in res.stderr.lower(), res.stderr
    assert took < 15, took
