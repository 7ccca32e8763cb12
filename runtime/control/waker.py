"""A pipe that wakes a thread from its poll: a byte written to it makes the read end readable.
The Client's I/O thread (runtime.api.client_io) and the server's client door
(runtime.serving.client_door) are woken this way when another thread hands them work."""

from __future__ import annotations

import os
import threading


class Waker:
    """The owner polls `read_fd`; any thread calls wake(). After close() a wake does nothing.
    The lock keeps a closed descriptor's number, which the OS may have handed out again, from
    being written."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(write_fd, False)
        self._write_fd: int | None = write_fd

    def wake(self) -> None:
        with self._lock:
            if self._write_fd is None:
                return
            try:
                os.write(self._write_fd, b"w")
            except OSError:
                pass  # the pipe is full: a wake is pending

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except OSError:  # BlockingIOError: drained
            pass

    def close(self) -> None:
        with self._lock:
            if self._write_fd is not None:
                os.close(self.read_fd)
                os.close(self._write_fd)
                self._write_fd = None
