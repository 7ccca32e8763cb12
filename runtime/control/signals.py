"""Signals: what they ask of a server (ServerStop: a drain, or a stop at once), and a pipe
that ends a blocking wait at once (SignalWakeup: the idle server's poll and a worker's wait
for the orchestrator's next message both include it)."""

from __future__ import annotations

import os
import signal
import threading


class ServerStop:
    """How signals end `tandem serve` (launcher.session installs on_signal for SIGINT and
    SIGTERM): the first SIGTERM sets `drain` (runtime.serving.server: admission closes, the
    requests in flight finish, within server.shutdown_timeout_s); SIGINT, a second signal,
    or SIGTERM when no drain is allowed (`drains` false: a timeout of 0) set `now`: serving
    stops at once, every request still answered."""

    def __init__(self, drains: bool):
        self.drains = drains
        self.drain = threading.Event()
        self.now = threading.Event()

    def on_signal(self, signum: int, _frame=None) -> None:
        if signum == signal.SIGTERM and self.drains and not self.drain.is_set():
            self.drain.set()
        else:
            self.now.set()


class SignalWakeup:
    """A pipe that signal.set_wakeup_fd writes a byte to on every signal: in a poll that
    includes `fds`, a stopping signal ends the wait at once (pyzmq runs the Python handler,
    which notes the signal, when the poll is interrupted, then polls on). Only the main
    thread can set it; elsewhere (no fds) a signal is seen when the wait ends (the server's
    IDLE_WAIT_S). The previous wake-up fd is restored on exit."""

    def __init__(self):
        self.fds: tuple[int, ...] = ()
        self._previous = -1

    def __enter__(self) -> SignalWakeup:
        if threading.current_thread() is not threading.main_thread():
            return self
        read_fd, write_fd = os.pipe()
        for fd in (read_fd, write_fd):
            os.set_blocking(fd, False)
        self._previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self.fds, self._write_fd = (read_fd,), write_fd
        return self

    def drain(self) -> None:
        for fd in self.fds:
            try:
                while os.read(fd, 512):
                    pass
            except BlockingIOError:
                pass

    def __exit__(self, *exc) -> None:
        if self.fds:
            signal.set_wakeup_fd(self._previous)
            os.close(self.fds[0])
            os.close(self._write_fd)
            self.fds = ()
