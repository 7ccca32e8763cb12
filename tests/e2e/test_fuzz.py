"""Hostile clients against one running `tandem serve`: a raw ZeroMQ DEALER sends garbage,
pickles, bombs and malformed requests. Nothing may crash, hang or slow the server down for
long; frames that are no valid message are dropped without a reply; a well-formed request
with a bad argument gets a `failed` reply of kind "value" naming the argument. Afterwards
the server still answers, with the same output as before. The workers' control sockets
listen on loopback only."""

from __future__ import annotations

import math
import os
import pickle
import random
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from types import SimpleNamespace

import msgpack
import pytest
import yaml
import zmq

from launcher.bootstrap import control_bind
from runtime import Client
from runtime.control import protocol, wire
from runtime.control.pool import WorkerPool
from tests import launch
from tests.processes import socket_inodes

pytestmark = pytest.mark.timeout(180)

PROMPT_IDS = [1, 5, 9, 13]
TEXT = "Once upon a time"
MAX_SEQ_LEN = 128


@pytest.fixture(scope="module")
def server(tokenized_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    draft, target = tokenized_pair
    cfg = root / "c.yaml"
    launch.write_config(cfg, draft, target, ("cpu:0",), ("cpu:0",), max_seq_len=MAX_SEQ_LEN)
    config = yaml.safe_load(cfg.read_text())
    address = f"tcp://127.0.0.1:{launch.free_port()}"
    config["server"] = {"address": address}
    cfg.write_text(yaml.safe_dump(config))
    err_path = root / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            launch.command("spawn", 2, ["serve", str(cfg)]),
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            env=launch.clean_env(),
        )
    client = Client(address, dead_after_s=120)
    try:
        client.info(timeout_s=120)
        client.dead_after_s = 30
        yield SimpleNamespace(client=client, proc=proc, address=address)
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        assert code == 0, err_path.read_text()[-3000:]
    launch.assert_group_gone(proc.pid)


@pytest.fixture(scope="module")
def reference(server):
    """Outputs before any fuzzing."""
    return (
        server.client.generate(prompt_token_ids=PROMPT_IDS, max_new_tokens=12).token_ids,
        server.client.generate(TEXT, max_new_tokens=12).text,
    )


# --- a raw client --------------------------------------------------------------------------
@contextmanager
def dealer(address: str):
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close(0)
        context.term()


def read(frame: bytes) -> dict:
    """The map of a reply (checked as the Client checks it)."""
    return wire.to_wire(protocol.decode(frame))


def replies(sock, timeout_s: float) -> list[dict]:
    """Every reply that arrives within timeout_s."""
    out, deadline = [], time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000)):
            return out
        out.append(read(sock.recv()))


def wait_reply(sock, rid: str, timeout_s: float = 30.0, others: list | None = None) -> dict:
    """The next final, failed or pong reply to request `rid`; replies to other requests
    that come meanwhile are appended to `others` when it is given."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            reply = read(sock.recv())
            if reply["id"] != rid:
                if others is not None:
                    others.append(reply)
            elif reply["type"] in ("final", "failed", "pong"):
                return reply
    raise AssertionError(f"no reply to {rid!r} within {timeout_s} s")


def ask(sock, msg: dict, timeout_s: float = 30.0, others: list | None = None) -> dict:
    """Send `msg` (msgpack, unchecked) and wait for the final or failed reply to its id."""
    sock.send(msgpack.packb(msg, use_bin_type=True))
    return wait_reply(sock, msg["id"], timeout_s, others)


def alive(sock, tag: str) -> None:
    """The server still reads this connection: a ping comes back, and nothing else did."""
    reply = ask(sock, {"type": "ping", "id": f"ping-{tag}"}, timeout_s=30)
    assert reply["type"] == "pong"


DROP = object()  # generate(field=DROP): leave the field out


def generate(**fields) -> dict:
    """A generate message (valid unless `fields` say otherwise)."""
    msg = {
        "type": "generate",
        "id": fields.pop("id", "g"),
        "stream": False,
        "prompt_ids": [PROMPT_IDS],
        "params": {"max_new_tokens": 4},
    }
    msg.update(fields)
    return {key: value for key, value in msg.items() if value is not DROP}


def assert_dropped(server, frames, tag: str) -> None:
    """Every frame is dropped without any reply, and the server stays responsive."""
    with dealer(server.address) as sock:
        for frame in frames:
            if isinstance(frame, list):
                sock.send_multipart(frame)
            else:
                sock.send(frame)
        got = replies(sock, 0.5)
        assert got == [], got
        alive(sock, tag)
    assert server.proc.poll() is None


# --- hostile frames ------------------------------------------------------------------------
def test_reference_output(server, reference):
    ids, text = reference
    assert len(ids) == 12 and text


def test_random_bytes(server):
    rng = random.Random(1234)
    frames = [
        bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 2, 5, 17, 300, 4000])))
        for _ in range(300)
    ]
    # random bytes behind a valid map prefix reach deeper into the decoder
    frames += [
        b"\x86\xa4type\xa8generate" + bytes(rng.getrandbits(8) for _ in range(60))
        for _ in range(100)
    ]
    assert_dropped(server, frames, "random")


class Payload:
    """Would create `marker` if anything unpickled it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickles_are_never_unpickled(server, tmp_path):
    marker = str(tmp_path / "unpickled")
    frames = [pickle.dumps(Payload(marker), protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)]
    frames += [pickle.dumps({"type": "ping", "id": "p"}), b"\x80\x03cbuiltins\nexec\n."]
    assert_dropped(server, frames, "pickle")
    # a pickle inside a valid message is just bytes where a string belongs
    with dealer(server.address) as sock:
        reply = ask(sock, generate(id="pk", prompt_ids=DROP, prompts=[frames[0]]))
        assert reply["type"] == "failed" and reply["kind"] == "value"
        assert "prompt" in reply["message"]
        reply = ask(sock, generate(id="pk2", params={"max_new_tokens": frames[0]}))
        assert reply["type"] == "failed" and "max_new_tokens" in reply["message"]
    assert not os.path.exists(marker)


def nested(depth: int, leaf=1):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def test_deep_nesting(server):
    deep_map: dict = {"x": 1}
    for _ in range(40):
        deep_map = {"x": deep_map}
    frames = [  # deeper than protocol.MAX_DEPTH (32: a tool's JSON schema nests)
        b"\x91" * 100_000 + b"\x01",  # 100k nested arrays
        b"\x81\xa1x" * 50_000 + b"\x01",  # 50k nested maps
        msgpack.packb(generate(id="deep1", prompt_ids=nested(40, [1]))),
        msgpack.packb(generate(id="deep2", params=deep_map)),
        msgpack.packb({"type": "ping", "id": "deep3", "x": nested(40)}),
    ]
    assert_dropped(server, frames, "deep")


def test_huge_declared_lengths(server):
    frames = [
        b"\xdd\xff\xff\xff\xff",  # array32 of 4 G elements, no data
        b"\xdd\x03\xff\xff\xff\x01\x02\x03",  # array32 of 67 M elements, 3 given
        b"\xdf\xff\xff\xff\xff\xa4type",  # map32 of 4 G pairs
        b"\xdb\xff\xff\xff\xff" + b"x" * 100,  # str32 of 4 GiB
        b"\xc6\x7f\xff\xff\xff" + b"x" * 100,  # bin32 of 2 GiB
        b"\x82\xa4type\xa4ping\xa2id\xdb\x10\x00\x00\x00abc",  # id: str32 of 256 MiB
        # 1.5 M empty lists in one frame: would cost ~100 MB of Python objects
        b"\xdd" + (3 << 19).to_bytes(4, "big") + b"\x90" * (3 << 19),
    ]
    start = time.monotonic()
    assert_dropped(server, frames, "lengths")
    assert time.monotonic() - start < 20


def test_extension_types(server):
    frames = [
        msgpack.packb(msgpack.ExtType(1, b"\x00" * 8)),
        msgpack.packb({"type": "ping", "id": msgpack.ExtType(42, b"x")}),
        msgpack.packb(generate(id="ext1", params={"max_new_tokens": msgpack.ExtType(5, b"x")})),
        # a reserved (negative) extension type where a token id belongs
        msgpack.packb(generate(id="ext2", prompt_ids=[[123456789]])).replace(
            msgpack.packb(123456789), b"\xd4\xfb1"
        ),
        msgpack.packb({"type": "ping", "id": msgpack.Timestamp(0)}, datetime=False),
    ]
    assert_dropped(server, frames, "ext")
    with dealer(server.address) as sock:  # a timestamp where an integer belongs
        reply = ask(
            sock, generate(id="ts", params={"max_new_tokens": 4, "seed": msgpack.Timestamp(3)})
        )
        assert reply["type"] == "failed" and "seed" in reply["message"], reply


def test_non_string_keys(server):
    frames = [
        msgpack.packb({1: 2}),
        msgpack.packb({b"type": b"ping", b"id": b"x"}, use_bin_type=True),
        msgpack.packb({"type": "ping", "id": "k", 7: 1}, strict_types=False),
        msgpack.packb(generate(id="keys", params={1: 4})),
        msgpack.packb(generate(id="keys2", params={"max_new_tokens": 4, (1, 2): 3})),
        msgpack.packb({None: "generate", "type": "ping", "id": "n"}),
    ]
    assert_dropped(server, frames, "keys")


WRONG = [1, -1, 2**63, 1.5, math.nan, True, None, "s", b"bytes", [], [1], [[1]], {}, {"a": 1}]


def _types_ok(msg: dict) -> bool:
    """Whether the message's fields have their types (runtime.control.wire's check)."""
    try:
        protocol.from_wire(msg)
    except protocol.ProtocolError:
        return False
    return True


@pytest.mark.parametrize("field", ["id", "prompts", "prompt_ids", "params", "stream", "chat"])
def test_wrong_types_in_every_generate_field(server, field):
    """A field of the wrong type is a malformed frame (dropped); a value of the right type
    that makes no sense is refused with a `failed` reply of kind "value". (The frames go out
    in WRONG's order without a pause; every reply that is not to the request being asked is
    kept, and none may come, up to 0.5 s after the last frame.)"""
    with dealer(server.address) as sock:
        dropped, others = [], []
        for i, value in enumerate(WRONG):
            msg = generate(id=f"w-{field}-{i}")
            if field == "prompts":
                msg.pop("prompt_ids")
            msg[field] = value
            if not _types_ok(msg):
                sock.send(msgpack.packb(msg, use_bin_type=True))
                dropped.append(value)
            else:
                reply = ask(sock, msg, others=others)
                assert reply["type"] == "final" or reply["kind"] == "value", reply
        others += replies(sock, 0.5)
        assert others == [], (field, dropped, others)
        alive(sock, f"types-{field}")


@pytest.mark.parametrize(
    "params,name",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": "4"}, "max_new_tokens"),
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_new_tokens": 2**63 - 1}, "max_new_tokens"),
        ({"max_new_tokens": MAX_SEQ_LEN}, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": math.nan}, "temperature"),
        ({"max_new_tokens": 4, "temperature": math.inf}, "temperature"),
        ({"max_new_tokens": 4, "temperature": -0.5}, "temperature"),
        ({"max_new_tokens": 4, "temperature": "hot"}, "temperature"),
        ({"max_new_tokens": 4, "top_p": math.nan}, "top_p"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 4, "top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 4, "top_k": -3}, "top_k"),
        ({"max_new_tokens": 4, "top_k": 2.5}, "top_k"),
        ({"max_new_tokens": 4, "seed": -1}, "seed"),
        ({"max_new_tokens": 4, "seed": "x"}, "seed"),
        ({"max_new_tokens": 4, "stop": [1, 2]}, "stop"),
        ({"max_new_tokens": 4, "stop": [""]}, "stop"),
        ({"max_new_tokens": 4, "stop": 5}, "stop"),
        ({"max_new_tokens": 4, "frequency_penalty": 2.5}, "frequency_penalty"),
        ({"max_new_tokens": 4, "presence_penalty": -3}, "presence_penalty"),
        ({"max_new_tokens": 4, "repetition_penalty": 0}, "repetition_penalty"),
        ({"max_new_tokens": 4, "logit_bias": {"x": 1}}, "logit_bias"),
        ({"max_new_tokens": 4, "logit_bias": {"5": 101}}, "logit_bias"),
        ({"max_new_tokens": 4, "logit_bias": {"999999": 1}}, "logit_bias"),  # past the vocab
        ({"max_new_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"max_new_tokens": 4, "n": 0}, "n"),
        ({"max_new_tokens": 4, "n": 10_000}, "server.max_n"),
        ({"max_new_tokens": 4, "logprobs": -1}, "logprobs"),
        ({"max_new_tokens": 4, "logprobs": 10_000}, "server.max_logprobs"),
        ({"max_new_tokens": 4, "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_new_tokens": 4, "structured_outputs": {"regex": 5}}, "structured_outputs"),
        ({"max_new_tokens": 4, "structured_outputs": {"json": {}, "regex": "a"}}, "structured"),
    ],
)
def test_bad_argument_gets_value_failure_naming_it(server, params, name):
    with dealer(server.address) as sock:
        reply = ask(sock, generate(id="bad", params=params))
    assert reply["type"] == "failed" and reply["kind"] == "value", reply
    assert name in reply["message"], reply


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"prompt_ids": [[1, 10**9]]}, "prompt_token_ids"),  # out of the vocabulary
        ({"prompt_ids": [[1, -1]]}, "prompt_token_ids"),
        ({"prompt_ids": [[1, 2**63]]}, "prompt_token_ids"),
        ({"prompt_ids": [[1, True]]}, "prompt_token_ids"),
        ({"prompt_ids": [[1, 2.0]]}, "prompt_token_ids"),
        ({"prompt_ids": [[1, "2"]]}, "prompt_token_ids"),
        ({"prompt_ids": [[]]}, "prompt_token_ids"),
        ({"prompt_ids": [1, 2, 3]}, "prompt_token_ids"),
        ({"prompt_ids": []}, "prompt"),
        ({"prompt_ids": [[1] * (MAX_SEQ_LEN + 1)]}, "runtime.max_seq_len"),
        ({"prompt_ids": DROP, "prompts": [""]}, "prompt"),
        ({"prompt_ids": DROP, "prompts": [7]}, "prompt"),
        ({"prompt_ids": DROP, "prompts": ["x" * 100_000]}, "runtime.max_seq_len"),  # too long
        ({"prompts": ["hello"]}, "exactly one"),  # both given
    ],
)
def test_bad_prompt_gets_value_failure(server, fields, name):
    msg = generate(id="badp", **fields)
    with dealer(server.address) as sock:
        reply = ask(sock, msg)
    assert reply["type"] == "failed" and reply["kind"] == "value", reply
    assert name in reply["message"], reply


def test_unknown_and_foreign_message_types(server):
    """Types the server does not take from clients: unknown ones, and the workers' own
    (a client cannot shut the engine down or inject steps)."""
    frames = [
        msgpack.packb(m)
        for m in (
            {"type": "exec", "id": "x"},
            {"type": "", "id": "x"},
            {"type": None},
            {"type": 1},
            {"type": ["generate"]},
            {},
            {"type": "shutdown"},
            {"type": "init", "config": {}, "heartbeat": "tcp://127.0.0.1:1"},
            {"type": "round", "step": 1, "slots": [0], "k": 4},
            {"type": "error", "rank": 1, "step": 1, "message": "boom"},
            {"type": "done", "rank": 1, "step": 1, "result": {}},
            {"type": "final", "id": "x", "outputs": []},
            {"type": "cancel", "id": "not-mine"},
        )
    ]
    assert_dropped(server, frames, "types")


def test_multipart_garbage(server):
    frames = [
        [b"a", b"b"],
        [b"", b"", b""],
        [b"\x00" * 10] * 20,
        [msgpack.packb({"type": "ping", "id": "mp"}), b"tail"],
        [b"", msgpack.packb({"type": "ping", "id": "mp2"})],
    ]
    assert_dropped(server, frames, "multipart")


def test_frame_larger_than_the_limit(server):
    """ZeroMQ drops the connection of a peer that sends more than MAX_MESSAGE_BYTES; the
    server goes on serving everybody else."""
    with dealer(server.address) as sock:
        sock.send(b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1))
        assert replies(sock, 1.0) == []
    with dealer(server.address) as sock:
        alive(sock, "big")
        reply = ask(sock, generate(id="after-big"))
        assert reply["type"] == "final"


def test_request_id_reuse_and_cancel_of_others(server):
    with dealer(server.address) as a, dealer(server.address) as b:
        a.send(msgpack.packb(generate(id="dup", params={"max_new_tokens": 40})))
        reply = ask(a, generate(id="dup"))
        assert reply["type"] == "failed" and "already in use" in reply["message"]
        b.send(msgpack.packb({"type": "cancel", "id": "dup"}))  # not b's request
        final = wait_reply(a, "dup")
        assert final["type"] == "final" and len(final["outputs"][0]["token_ids"]) == 40


def test_still_serving_the_same_output(server, reference):
    ids, text = reference
    assert server.proc.poll() is None
    client = server.client
    assert client.generate(prompt_token_ids=PROMPT_IDS, max_new_tokens=12).token_ids == ids
    assert client.generate(TEXT, max_new_tokens=12).text == text
    stats = client.stats()
    assert stats["running"] == 0 and stats["queued"] == 0


# --- the workers' control plane is loopback only --------------------------------------------
def test_pool_binds_loopback_by_default(monkeypatch):
    monkeypatch.delenv("TANDEM_CONTROL_HOST", raising=False)
    assert control_bind() == "tcp://127.0.0.1"
    context = zmq.Context()
    pool = WorkerPool((1, 2), context)
    try:
        assert pool.address.startswith("tcp://127.0.0.1:")
        assert pool.beacon.address.startswith("tcp://127.0.0.1:")
    finally:
        pool.close()
        context.term()


def _listening() -> dict[str, tuple[str, int]]:
    """socket inode -> (local address, port) of every listening TCP socket."""
    out = {}
    for path, _width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(path) as fh:
            for line in fh.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A":  # LISTEN
                    host, port = cols[1].split(":")
                    out[cols[9]] = (host, int(port, 16))
    return out


def _external_ip() -> str | None:
    """A non-loopback IPv4 address of this host, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # no packet is sent
            ip = probe.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


def test_control_sockets_unreachable_from_outside(server):
    """Every socket the running orchestrator listens on (the workers' control ROUTER, the
    heartbeat beacon, the rendezvous store, the client server here) is bound to 127.0.0.1,
    not to a wildcard or external address; through this host's external address their ports
    refuse connections."""
    listening = _listening()
    mine = [listening[i] for i in socket_inodes(server.proc.pid) if i in listening]
    server_port = int(server.address.rsplit(":", 1)[1])
    assert server_port in {port for _, port in mine}, mine
    assert len(mine) >= 4, mine  # control ROUTER, beacon PUB, store, server
    for host, port in mine:
        assert host == "0100007F", f"port {port} listens on {host}, not 127.0.0.1"
    ip = _external_ip()
    if ip is None:
        pytest.skip("this host has no external address to try")
    for _, port in mine:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.settimeout(2)
            assert probe.connect_ex((ip, port)) != 0, f"{ip}:{port} accepted a connection"
