"""runtime.control.pool.WorkerPool on loopback with fake workers (DEALER sockets of this process):
heartbeats queued while the orchestrator stalled count before heartbeat ages are judged."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq

from runtime import EngineDeadError
from runtime.control import protocol
from runtime.control.pool import WorkerPool

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pool():
    context = zmq.Context()
    pool = WorkerPool((1, 2), context, heartbeat_s=0.1, dead_after_s=1.0)
    try:
        yield pool
    finally:
        pool.close()
        context.destroy(linger=0)


def dealer(pool: WorkerPool, rank: int) -> zmq.Socket:
    sock = pool.sock.context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"w{rank}".encode())
    sock.connect(pool.address)
    return sock


def send(sock: zmq.Socket, pool: WorkerPool, msg: dict) -> None:
    """The message of a map (runtime.control.wire.from_wire), signed as the pool expects."""
    sock.send(protocol.encode(protocol.from_wire(msg), pool.key))


def pulse(pool: WorkerPool) -> zmq.Socket:
    """A worker's Pulse socket: where heartbeats go."""
    sock = pool.sock.context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pool.pulse_address)
    return sock


def beating(pool: WorkerPool, stop: threading.Event) -> threading.Thread:
    """Ranks 1 and 2 heartbeat every 0.1 s from a thread until `stop` is set."""

    def run() -> None:
        socks = [pulse(pool) for _ in pool.ranks]
        try:
            while not stop.wait(0.1):
                for rank, sock in zip(pool.ranks, socks):
                    send(sock, pool, {"type": "heartbeat", "rank": rank})
        finally:
            for sock in socks:
                sock.close(0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("call", ["check_alive", "idle", "wait_for"])
def test_stalled_orchestrator_does_not_misread_live_workers(pool, call):
    """The pool does not poll for 2 s (twice dead_after_s: a long prefill, a GC pause) while
    both workers keep heartbeating: their queued beats count, nobody is declared dead."""
    stop = threading.Event()
    thread = beating(pool, stop)
    try:
        time.sleep(2.0)  # the stall: nothing reads the socket
        if call == "check_alive":
            pool.check_alive()
        elif call == "idle":
            pool.idle(0)
        else:
            with pytest.raises(EngineDeadError, match="did not answer 'done'"):
                pool.wait_for(protocol.Done, 0.5)  # times out waiting, not on heartbeats
        assert pool.dead is None or "heartbeat" not in pool.dead
    finally:
        stop.set()
        thread.join(5)


def test_error_after_stall_is_not_blamed_on_a_live_rank(pool):
    """Rank 1 reports an error, then rank 2's heartbeat (queued behind it, as after a stall):
    the error is reported as rank 1's, not as rank 2 having gone silent."""
    pool.dead_after_s = 10.0
    sock, beats = dealer(pool, 1), pulse(pool)
    try:
        time.sleep(2.0)  # both ranks' last beats are 2 s old now
        send(beats, pool, {"type": "heartbeat", "rank": 1})
        send(sock, pool, {"type": "error", "rank": 1, "step": 1, "message": "rank 1: boom"})
        send(beats, pool, {"type": "heartbeat", "rank": 2})
        time.sleep(0.2)  # all three are queued
        with pytest.raises(EngineDeadError) as info:
            pool.wait_for(protocol.Done, 5.0, step=1)
        assert str(info.value) == "rank 1: boom", str(info.value)
    finally:
        sock.close(0)
        beats.close(0)


def test_dead_child_is_named_with_its_exit_status_once_it_can_be_reaped():
    """A child whose process is gone but not yet reapable (the kernel is still tearing it
    down, or another thread holds its wait lock) is named with its signal, not just 'died'."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    calls = []

    def liveness(exclude=()):
        calls.append(1)
        if len(calls) < 5:  # the first looks find nothing to report yet
            return None
        code = child.poll()
        return None if code is None else f"rank 1 (pid {child.pid}) was killed by SIGKILL"

    context = zmq.Context()
    pool = WorkerPool((1,), context, liveness=liveness)
    try:
        pool.processes[1] = (socket.gethostname(), child.pid)
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert pool._gone() == f"rank 1 (pid {child.pid}) was killed by SIGKILL"
        assert len(calls) >= 5
    finally:
        pool.close()
        context.destroy(linger=0)


@pytest.fixture
def orphan():
    """A process on this host that is not our child (as workers are under mpirun and
    torchrun): a shell starts it in the background and exits."""
    out = subprocess.run(
        ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    pid = int(out.stdout.strip())
    yield pid
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs os.pidfd_open (Linux)")
@pytest.mark.parametrize("call", ["wait_for", "idle"])
def test_local_worker_that_is_not_our_child_is_named_at_once(orphan, call):
    """A local worker killed while the pool waits is named within a second, not after the
    heartbeat limit (30 s here): the pool watches the pidfds of the workers on its host."""
    context = zmq.Context()
    pool = WorkerPool((1,), context, heartbeat_s=0.1, dead_after_s=30.0)
    sock = dealer(pool, 1)
    try:
        send(sock, pool, {"type": "hello", "rank": 1, "pid": orphan, "host": socket.gethostname()})
        pool.handshake({}, 10)
        threading.Timer(0.3, os.kill, (orphan, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {orphan}\) (died|exited)"):
            if call == "wait_for":
                pool.wait_for(protocol.Done, 20)
            else:
                while time.monotonic() - start < 20:
                    pool.idle(50)
        assert time.monotonic() - start < 1.5
    finally:
        sock.close(0)
        pool.close()
        context.destroy(linger=0)


def test_the_beacon_thread_reads_the_pulses_of_an_idle_pool(pool):
    """Heartbeats to the pulse socket (where the workers' Pulse threads send them) are read
    by the Beacon's thread every quarter of dead_after_s while the main thread does nothing,
    and forged ones do not count."""
    sock = pulse(pool)
    try:
        before = dict(pool.last_seen)
        for _ in range(5):
            sock.send(protocol.encode(protocol.Heartbeat(1), pool.key))
            sock.send(protocol.encode(protocol.Heartbeat(2), b"not the key"))
            time.sleep(0.1)
        deadline = time.monotonic() + 5
        while pool.last_seen[1] == before[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.last_seen[1] > before[1]  # no call on this thread read it
        assert pool.last_seen[2] == before[2]  # the forged heartbeat did not count
    finally:
        sock.close(0)


def test_an_idle_wait_ends_when_a_heartbeat_could_be_too_old(pool):
    """idle() asked to wait 30 s returns by the time the oldest heartbeat passes
    dead_after_s (1 s here), and then names the silent rank."""
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="sent no heartbeat"):
        while time.monotonic() - start < 10:
            pool.idle(30_000)
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("rank2_next_s", [1.0, 2.5])
def test_a_failure_is_blamed_on_a_rank_only_once_its_promised_heartbeat_is_overdue(rank2_next_s):
    """Each heartbeat says when the next one comes (an idle worker beats every 2.5 periods):
    rank 1's error 2.3 s after both ranks' last heartbeats names rank 2 as its cause only
    when rank 2 promised its next within 1 s (overdue twice over), not within 2.5 s."""
    context = zmq.Context()
    pool = WorkerPool((1, 2), context, heartbeat_s=1.0, dead_after_s=30.0)
    sock, beats = dealer(pool, 1), pulse(pool)
    try:
        send(beats, pool, {"type": "heartbeat", "rank": 1, "next_s": 2.5})
        send(beats, pool, {"type": "heartbeat", "rank": 2, "next_s": rank2_next_s})
        time.sleep(0.2)
        pool.check_alive()  # both heartbeats read
        time.sleep(2.1)
        send(sock, pool, {"type": "error", "rank": 1, "step": 1, "message": "rank 1: boom"})
        with pytest.raises(EngineDeadError) as info:
            pool.wait_for(protocol.Done, 5.0, step=1)
        blamed = str(info.value).startswith("rank 2 sent no heartbeat")
        assert blamed == (rank2_next_s == 1.0), str(info.value)
    finally:
        sock.close(0)
        beats.close(0)
        pool.close()
        context.destroy(linger=0)
