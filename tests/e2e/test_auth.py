"""HMAC authentication of control frames, and binds beyond loopback refused without a key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runtime.control import auth, protocol
from runtime.control.commands import TARGET_LEADER, RoundReply
from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(120)


def key_file(tmp_path, text="0123456789abcdef0123456789abcdef"):
    path = tmp_path / "key"
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def test_signed_frames_round_trip_and_forgeries_fail(tmp_path):
    key = auth.load_key(key_file(tmp_path))
    msg = protocol.Ping("x")
    frame = protocol.encode(msg, key)
    assert protocol.decode(frame, key) == msg
    for bad in (protocol.encode(msg), frame[:-1] + b"\0", b"", protocol.encode(msg, b"k" * 32)):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode(bad, key)


def test_key_file_rules(tmp_path):
    with pytest.raises(auth.AuthError, match="at least"):
        auth.load_key(key_file(tmp_path, "short"))
    path = key_file(tmp_path)
    os.chmod(path, 0o644)
    with pytest.raises(auth.AuthError, match="chmod 600"):
        auth.load_key(path)
    with pytest.raises(auth.AuthError, match="cannot read"):
        auth.load_key(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "address,loopback",
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://localhost:1", True),
        ("ipc:///tmp/x", True),
        ("tcp://[::1]:5", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.1.2.3:5555", False),
    ],
)
def test_loopback_detection(address, loopback):
    assert auth.is_loopback(address) == loopback


def test_control_host_beyond_loopback_needs_a_key(tmp_path):
    target = checkpoints.build_checkpoint(tmp_path / "t", "llama", seed=0)
    cfg = launch.write_config(tmp_path / "c.yaml", target, target)
    env = dict(launch.clean_env(), TANDEM_CONTROL_HOST="0.0.0.0")
    res = subprocess.run(
        [sys.executable, "-m", "launcher", "run", cfg, "--prompt-ids", "1,2"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 2 and "TANDEM_AUTH_KEY_FILE" in res.stderr


def test_authenticated_control_plane_runs(tmp_path):
    target = checkpoints.build_checkpoint(tmp_path / "t", "llama", seed=0)
    cfg = launch.write_config(tmp_path / "c.yaml", target, target)
    env = dict(
        launch.clean_env(), TANDEM_CONTROL_HOST="127.0.0.1", TANDEM_AUTH_KEY_FILE=key_file(tmp_path)
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "run",
            cfg,
            "--prompt-ids",
            "1,2",
            "--max-new-tokens",
            "6",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert '"token_ids"' in res.stdout


def test_server_beyond_loopback_serves_only_keyed_clients(tmp_path):
    import signal

    import yaml

    from runtime import Client, EngineDeadError

    target = checkpoints.build_checkpoint(tmp_path / "t", "llama", seed=0)
    cfg_path = launch.write_config(tmp_path / "c.yaml", target, target, ["cpu:0"], ["cpu:0"])
    cfg = yaml.safe_load(open(cfg_path))
    address = f"tcp://0.0.0.0:{launch.free_port()}"
    cfg["server"] = {"address": address, "auth_key_file": key_file(tmp_path)}
    open(cfg_path, "w").write(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", "serve", cfg_path],
        start_new_session=True,
        env=launch.clean_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    local = address.replace("0.0.0.0", "127.0.0.1")
    try:
        with Client(local, auth_key_file=cfg["server"]["auth_key_file"]) as client:
            client.info(timeout_s=90)
            out = client.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=4)
            assert len(out.token_ids) == 4
        with Client(local) as stranger:  # unsigned frames are dropped
            with pytest.raises(EngineDeadError):
                stranger.info(timeout_s=3)
        assert launch.stop(proc, 30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    launch.assert_group_gone(proc.pid)


def test_forged_worker_frames_are_dropped(tmp_path):
    """No key file: rank 0 makes a key for this launch and hands it to the workers over
    torch.distributed; a local process that connects to the workers' control socket and
    forges their "error" and "done" frames is ignored (logged), and the output is right."""
    import re
    import signal
    import threading
    import time

    import zmq

    from runtime import Client

    target = checkpoints.build_checkpoint(tmp_path / "t", "llama", seed=0)
    draft = checkpoints.build_near_draft(target, tmp_path / "d", noise=0.05)
    cfg = launch.write_config(tmp_path / "c.yaml", draft, target)
    address = f"ipc://{tmp_path}/server.sock"
    env = dict(launch.clean_env(), TANDEM_LOG="INFO")
    env.pop(auth.CONTROL_KEY_ENV, None)
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            launch.command("spawn", 3, ["serve", cfg, "--address", address]),
            stderr=err,
            start_new_session=True,
            env=env,
        )
    stop = threading.Event()

    def forge(control: str) -> None:
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(control)
        wrong = protocol.encode(protocol.Error(2, 1, "x"), b"k" * 32)
        verdict = RoundReply(TARGET_LEADER, 0.0, {}, [[7]], [0])  # well formed, unsigned
        while not stop.wait(0.05):
            sock.send(protocol.encode(protocol.Error(1, 1, "FORGED-ERROR")))
            sock.send(wrong)
            for step in range(1, 41):
                sock.send(protocol.encode(protocol.Done(2, step, verdict)))
        sock.close(0)
        context.term()

    try:
        with Client(address, dead_after_s=120) as client:
            client.info(timeout_s=120)
            ids = client.generate(prompt_token_ids=[1, 5, 9, 13], max_new_tokens=24).token_ids
            control = re.search(
                r"control plane at (tcp://\S+) \(key of this launch\)", err_path.read_text()
            ).group(1)
            forger = threading.Thread(target=forge, args=(control,), daemon=True)
            forger.start()
            time.sleep(0.5)
            for _ in range(3):
                out = client.generate(prompt_token_ids=[1, 5, 9, 13], max_new_tokens=24)
                assert out.token_ids == ids
            stop.set()
            forger.join(10)
        log = err_path.read_text()
        assert "dropped a worker frame: frame signature does not match" in log, log[-2000:]
        assert "FORGED-ERROR" not in log, log[-2000:]
        assert launch.stop(proc, 30) == 0, err_path.read_text()[-2000:]
    finally:
        stop.set()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    launch.assert_group_gone(proc.pid)
