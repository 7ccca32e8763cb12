"""A worker's end of the control plane: its ZeroMQ socket to the orchestrator (msgpack,
runtime.control.protocol), the signals that stop it, and the orchestrator's liveness (its
Pulse, from init on). WorkerExit leaves the worker loop."""

from __future__ import annotations

import logging
import time

import zmq

from runtime.control import auth, protocol
from runtime.control.heartbeat import Pulse
from runtime.control.protocol import Message, ProtocolError, Shutdown
from runtime.control.signals import SignalWakeup

log = logging.getLogger("tandem.worker")


class WorkerExit(Exception):
    """Leave the worker loop (orphaned, told to stop by a signal, or after reporting a
    problem of the config that rank 0 names to the user: `reported`)."""

    def __init__(self, message: str, code: int = 1, reported: bool = False):
        super().__init__(message)
        self.code = code
        self.reported = reported


SIGNAL_GRACE_S = 5.0  # after SIGINT/SIGTERM, wait this long for the orchestrator's shutdown
ERROR_GRACE_S = 3.0  # after reporting an error, as long (launcher.bootstrap.DEAD_GRACE_S)


class ControlLink:
    """A worker's end of the control plane, before init and after: its socket, the signals
    that stop it, the orchestrator's liveness (by its Pulse, from init on; set by the startup,
    runtime.worker.process.start)."""

    def __init__(self, rank: int, sock: zmq.Socket):
        self.rank = rank
        self.sock = sock
        self.pulse: Pulse | None = None  # from init on
        self.signalled_at: float | None = None
        # after a signal, how long to wait for the orchestrator's shutdown: from init on
        # also its drain's bound (server.shutdown_timeout_s: it finishes the requests in
        # flight first, and needs this worker meanwhile)
        self.grace_s = SIGNAL_GRACE_S
        self.wakeup = SignalWakeup()  # entered by run_worker: a signal ends recv's wait
        self._poller: zmq.Poller | None = None

    def on_signal(self, signum, _frame) -> None:
        """SIGINT/SIGTERM (e.g. forwarded by torchrun or mpirun): the orchestrator gets it too
        and sends shutdown (after its drain, on SIGTERM); serve on until then, and exit
        cleanly on that, or on our own after `grace_s`. A normal way to stop (Ctrl-C
        reaches every process of the terminal's group): info."""
        log.info("rank %d: received signal %d", self.rank, signum)
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()

    def send(self, msg: Message) -> None:
        self.sock.send(protocol.encode(msg, auth.control_key()))

    def recv(self, timeout_s: float) -> Message:
        """Next valid message from the orchestrator; WorkerExit when it has gone silent
        (before init: no message within timeout_s; after: no beacon beat for timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.signalled_at is not None:
                # a live orchestrator got the signal too and sends shutdown at once; one
                # killed together with us (torchrun tearing the job down) never will
                if time.monotonic() - self.signalled_at > self.grace_s:
                    raise WorkerExit("stopped by signal", code=0)
            if self.pulse is not None:
                if self.pulse.orchestrator_silent_s > timeout_s:
                    raise WorkerExit(f"orchestrator silent for {timeout_s:.0f} s; exiting")
            elif time.monotonic() > deadline:
                raise WorkerExit(f"no word from the orchestrator within {timeout_s:.0f} s")
            # block until a message or a signal comes or a check above could first turn true:
            # an idle worker's main thread wakes about once per silence limit, not each second
            if not self._wait(self._recv_wait_ms(deadline, timeout_s)):
                continue
            frame = self.sock.recv()
            try:
                return protocol.decode(frame, auth.control_key())
            except protocol.ProtocolError as exc:
                log.warning("rank %d: dropped control frame: %s", self.rank, exc)

    def _wait(self, timeout_ms: int) -> bool:
        """Whether a frame waits on the socket, after at most timeout_ms; a signal ends the
        wait early (self.wakeup, set by run_worker)."""
        if not self.wakeup.fds:
            return bool(self.sock.poll(timeout_ms))
        if self._poller is None:
            self._poller = zmq.Poller()
            self._poller.register(self.sock, zmq.POLLIN)
            for fd in self.wakeup.fds:
                self._poller.register(fd, zmq.POLLIN)
        ready = dict(self._poller.poll(timeout_ms))
        self.wakeup.drain()
        return self.sock in ready

    def _recv_wait_ms(self, deadline: float, timeout_s: float) -> int:
        """How long recv may block: until the earliest moment one of its checks could turn
        true (its deadline, the orchestrator's silence limit, after a signal the grace
        period), at least 10 ms. Without a signal wake-up pipe (not the main thread) at most
        a heartbeat period, so that a signal is seen that soon."""
        now = time.monotonic()
        period = self.pulse.period_s if self.pulse is not None else 1.0
        waits = [] if self.wakeup.fds else [period]
        if self.pulse is None:
            waits.append(deadline - now)
        else:
            waits.append(timeout_s - self.pulse.orchestrator_silent_s)
        if self.signalled_at is not None:
            waits.append(self.grace_s - (now - self.signalled_at))
        return max(10, int(1000 * min(waits)) + 1)

    def await_shutdown(self, timeout_s: float) -> None:
        """After reporting an error, wait (at most timeout_s, or until the orchestrator goes
        silent) for its shutdown, so that it can name the cause to the clients first: MPICH's
        hydra tears the whole job down as soon as a rank exits after another one died."""
        deadline = time.monotonic() + timeout_s
        while (
            time.monotonic() < deadline
            and self.pulse is not None
            and self.pulse.orchestrator_silent_s < 3 * self.pulse.period_s
        ):
            if self.sock.poll(100):
                try:
                    if isinstance(protocol.decode(self.sock.recv(), auth.control_key()), Shutdown):
                        return
                except ProtocolError:
                    pass

    def close(self) -> None:
        if self.pulse is not None:
            self.pulse.stop()
