"""A Client at an address where nothing listens fails within seconds, naming the address;
one that reached something there (a server gone silent, or something that is no tandem
server) still gets the long silence limit; info(timeout_s=...) waits for a server that is
still starting, and a Client that found nobody works once a server is there."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from runtime import EngineDeadError
from runtime.api.client import CONNECT_TIMEOUT_S, Client
from tests.fake_server import PingServer
from tests.launch import free_port

pytestmark = pytest.mark.timeout(60)


INFO = {"vocab_size": 100, "max_seq_len": 64, "model": "fake"}


def ping_server(address: str) -> PingServer:
    """A minimal tandem server at `address`: it answers pings and nothing else."""
    return PingServer(INFO, address)


def fails_fast(call, address: str, detail: str) -> None:
    start = time.monotonic()
    with pytest.raises(EngineDeadError) as err:
        call()
    took = time.monotonic() - start
    assert f"no tandem server at {address}" in str(err.value)
    assert detail in str(err.value)
    assert CONNECT_TIMEOUT_S - 0.5 < took < 5.0, took


@pytest.mark.parametrize("call", ["info", "generate", "stats"])
def test_nothing_on_a_tcp_port(call):
    address = f"tcp://127.0.0.1:{free_port()}"
    with Client(address) as client:
        calls = {
            "info": client.info,
            "stats": client.stats,
            "generate": lambda: client.generate("hi", max_new_tokens=2),
        }
        fails_fast(calls[call], address, f"no connection within {CONNECT_TIMEOUT_S:g} s")


def test_no_ipc_socket_file_then_a_server(tmp_path):
    """The verdict is the call's, not the client's: once a server listens, calls work."""
    address = f"ipc://{tmp_path}/server.sock"
    with Client(address) as client:
        fails_fast(
            lambda: client.generate(prompt_token_ids=[1, 2], max_new_tokens=2),
            address,
            f"no socket file {tmp_path}/server.sock",
        )
        server = ping_server(address)
        try:
            assert client.info()["model"] == "fake"
        finally:
            server.close()


def test_info_with_a_timeout_waits_for_a_starting_server(tmp_path):
    address = f"ipc://{tmp_path}/server.sock"
    servers: list[PingServer] = []
    starter = threading.Timer(CONNECT_TIMEOUT_S + 1.5, lambda: servers.append(ping_server(address)))
    starter.start()
    try:
        with Client(address) as client:
            start = time.monotonic()
            assert client.info(timeout_s=30)["model"] == "fake"
            assert time.monotonic() - start > CONNECT_TIMEOUT_S + 1.0
    finally:
        starter.join()
        for server in servers:
            server.close()


def test_info_with_a_timeout_names_the_missing_server():
    address = f"tcp://127.0.0.1:{free_port()}"
    with Client(address) as client:
        with pytest.raises(EngineDeadError, match=f"no tandem server at {address}.*waited 1 s"):
            client.info(timeout_s=1)


def test_something_that_is_no_tandem_server_gets_the_silence_limit():
    """A connection is made (a plain TCP listener that never speaks ZeroMQ): that is not
    "nothing listens", so the call waits dead_after_s, as for a server gone silent."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with Client(address, dead_after_s=CONNECT_TIMEOUT_S + 3) as client:
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="silent for"):
                client.generate("hi", max_new_tokens=2)
            assert time.monotonic() - start > CONNECT_TIMEOUT_S + 2.5
    finally:
        listener.close()


def test_a_server_heard_once_gets_the_silence_limit_then_is_found_again(tmp_path):
    address = f"ipc://{tmp_path}/server.sock"
    server = ping_server(address)
    with Client(address, dead_after_s=CONNECT_TIMEOUT_S + 3) as client:
        client.info()
        server.close()  # silent from now on
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="silent for"):
            client.generate("hi", max_new_tokens=2)
        assert time.monotonic() - start > CONNECT_TIMEOUT_S + 1.5
        with pytest.raises(EngineDeadError, match="silent for"):  # while it stays silent
            client.info()
        server = ping_server(address)  # it answers again: the client finds it (no
        try:  # permanent 503 in an HTTP front over it)
            assert client.info()["model"] == "fake"
        finally:
            server.close()


@pytest.mark.parametrize(
    "ids, max_new, pattern",
    [
        (
            [[1] * 64],
            1,
            r"^prompt_token_ids: the prompt is 64 tokens, too long for "
            r"runtime\.max_seq_len \(64\)",
        ),
        ([[1] * 4, [1] * 70], 1, r"^prompt_token_ids: prompt 2 is 70 tokens"),
        (
            [[1] * 60],
            8,
            r"^max_new_tokens: the prompt \(60 tokens\) \+ max_new_tokens \(8\) "
            r"exceeds runtime\.max_seq_len \(64\); at most 4 new tokens fit",
        ),
    ],
)
def test_prompt_ids_that_cannot_fit_are_refused_before_sending(tmp_path, ids, max_new, pattern):
    """The client checks token-id prompts against the server's runtime.max_seq_len with the
    orchestrator's own check (params.check_fits): the same message, nothing sent."""
    server = ping_server(f"ipc://{tmp_path}/server.sock")
    try:
        with Client(server.address) as client:
            with pytest.raises(ValueError, match=pattern):
                client.generate(
                    prompt_token_ids=ids if len(ids) > 1 else ids[0], max_new_tokens=max_new
                )
    finally:
        server.close()
