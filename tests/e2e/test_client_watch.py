"""The client watches the server's processes on its host (the table in the server's pong):
when a worker dies and the server goes down before it can say so (MPICH's hydra may kill it
within milliseconds), the pending calls still raise EngineDeadError naming that rank."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from runtime import EngineDeadError
from runtime.api.client import WORKER_DEATH_GRACE_S, Client
from tests.fake_server import PingServer

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open"),
]


def orphan() -> int:
    """A process on this host that is not our child."""
    out = subprocess.run(
        ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return int(out.stdout.strip())


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def fake_server(server_pid: int, worker_pid: int) -> PingServer:
    """Answers pings with a process table (server pid, rank 1's pid) and nothing else."""
    host = socket.gethostname()
    return PingServer(
        {
            "vocab_size": 100,
            "max_seq_len": 64,
            "has_tokenizer": False,
            "model": "fake",
            "server": [host, server_pid],
            "processes": {"1": [host, worker_pid]},
        }
    )


@pytest.mark.parametrize("server_dies", [True, False])
def test_pending_call_names_the_dead_local_worker(server_dies):
    server_pid, worker_pid = orphan(), orphan()
    server = fake_server(server_pid, worker_pid)
    client = Client(server.address, dead_after_s=30)
    try:
        client.info(10)
        failure: list[BaseException] = []

        def call() -> None:
            try:
                client.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=4)
            except BaseException as exc:  # noqa: BLE001 - checked below
                failure.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.3)
        kill(worker_pid)
        if server_dies:
            time.sleep(0.05)
            kill(server_pid)
        start = time.monotonic()
        caller.join(10)
        took = time.monotonic() - start
        assert failure and isinstance(failure[0], EngineDeadError), failure
        assert f"rank 1 (pid {worker_pid}) died" in str(failure[0])
        if server_dies:
            assert "the server exited before it reported it" in str(failure[0])
            assert took < 1.0
        else:  # a live server gets the grace period to report it itself
            assert f"within {WORKER_DEATH_GRACE_S:.0f} s" in str(failure[0])
            assert WORKER_DEATH_GRACE_S - 0.5 < took < WORKER_DEATH_GRACE_S + 1.5
        with pytest.raises(EngineDeadError, match=f"rank 1 \\(pid {worker_pid}\\) died"):
            client.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=4)  # at once
    finally:
        client.close()
        server.close()
        kill(server_pid)
        kill(worker_pid)


def test_a_server_that_died_first_is_the_cause():
    """The server dies, then its worker (as with PR_SET_PDEATHSIG): the server is named,
    not the worker, and at once."""
    server_pid, worker_pid = orphan(), orphan()
    server = fake_server(server_pid, worker_pid)
    client = Client(server.address, dead_after_s=30)
    try:
        client.info(10)
        kill(server_pid)
        time.sleep(0.05)
        kill(worker_pid)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=f"tandem server \\(pid {server_pid}\\) is gone"):
            client.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=4)
        assert time.monotonic() - start < 1.0
    finally:
        client.close()
        server.close()
        kill(worker_pid)


def test_no_process_table_no_watch():
    """A server that sends no process table (an older one): nothing is watched."""
    server_pid, worker_pid = orphan(), orphan()
    server = fake_server(server_pid, worker_pid)
    del server.info["processes"], server.info["server"]
    client = Client(server.address, dead_after_s=30)
    try:
        assert client.info(10)["model"] == "fake"
        kill(worker_pid)
        time.sleep(0.3)
        assert client._dead is None
    finally:
        client.close()
        server.close()
        kill(server_pid)


def test_a_call_leaves_at_once():
    """A message handed to the I/O thread wakes it: even with an hour-long poll interval, each
    call is answered at once (the fake server answers pings)."""

    class SlowPollClient(Client):
        POLL_MS = 3_600_000

    server = fake_server(os.getpid(), os.getpid())
    client = SlowPollClient(server.address, dead_after_s=30)
    try:
        start = time.monotonic()
        for _ in range(5):
            assert client.info(10)["model"] == "fake"
        assert time.monotonic() - start < 5.0
    finally:
        client.close()
        server.close()
