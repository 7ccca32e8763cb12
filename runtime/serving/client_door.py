"""The server's door to its clients: the ROUTER socket, owned by a thread of its own.

Whether a client or the server is alive never depends on how long one step runs. This thread
reads every client frame as it arrives, notes when each client was last heard from, and
answers pings at once: with `starting` while the workers load, with `pong` and the server's
facts once it serves. Every other frame waits in the inbox for the serving loop
(runtime.serving.server), which wakes on `wake_fd`; the loop's replies leave through an
outbox that this thread sends. ZeroMQ sockets are not thread-safe: only this thread touches
the socket. The socket is bound when the door is made, before any worker starts, so a taken
address is an error at once (launcher.session).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import zmq

from runtime.control import protocol
from runtime.control.protocol import (
    Cancel,
    ClientReply,
    ClientRequest,
    Failed,
    Ping,
    Pong,
    Starting,
)
from runtime.control.waker import Waker

log = logging.getLogger("tandem.server")
POLL_MS = 1000  # the thread's longest wait; frames, replies and close() wake it
FRAMES_PER_PASS = 1000  # client frames read before the outbox is sent again
CLOSE_LINGER_MS = 500  # how long replies still queued at close get to leave


class ClientDoor:
    def __init__(self, address: str, context: zmq.Context, key: bytes | None = None):
        """Bind `address` (zmq.ZMQError when it is taken) and start the thread. `key`: the
        HMAC key every frame in and out is signed with (runtime.control.auth)."""
        self.key = key
        self.info: dict | None = None  # the pong's facts; None: answer `starting`
        self.failure: str | None = None  # why the thread ended early (the loop raises it)
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.setsockopt(zmq.RCVHWM, 10000)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        try:
            sock.bind(address)
        except zmq.ZMQError:
            sock.close(0)
            raise
        self._sock = sock
        self._inbox: deque[tuple[bytes, ClientRequest]] = deque()  # deques: thread-safe ends
        self._outbox: deque[tuple[bytes, ClientReply]] = deque()
        self._to_door, self._to_loop = Waker(), Waker()
        self._seen: dict[bytes, float] = {}  # client identity -> when last heard from
        self._refusal: str | None = None  # once set: every request is failed with it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-clients", daemon=True)
        self._thread.start()

    # --- the serving loop's side ---------------------------------------------------------
    @property
    def wake_fd(self) -> int:
        """Readable when frames wait in the inbox (or the thread failed)."""
        return self._to_loop.read_fd

    def take(self, limit: int) -> list[tuple[bytes, ClientRequest]]:
        """Up to `limit` waiting (identity, request) frames, oldest first."""
        self._to_loop.drain()  # before taking: a frame queued after this wakes us again
        frames: list[tuple[bytes, ClientRequest]] = []
        while self._inbox and len(frames) < limit:
            frames.append(self._inbox.popleft())
        return frames

    @property
    def waiting(self) -> bool:
        return bool(self._inbox)

    def reply(self, identity: bytes, msg: ClientReply) -> None:
        self._outbox.append((identity, msg))
        self._to_door.wake()

    def last_seen(self, identity: bytes) -> float | None:
        return self._seen.get(identity)

    def forget_before(self, when: float) -> None:
        """Drop the clients last heard from before `when` (the table stays bounded)."""
        for identity, seen in list(self._seen.items()):
            if seen < when:
                self._seen.pop(identity, None)

    def refuse(self, message: str) -> None:
        """No loop takes frames any more (the server is stopping, or never started): from now
        on every request waiting or arriving is answered `failed` (kind "dead") with
        `message` at once."""
        self._refusal = message
        self._to_door.wake()

    def close(self, message: str = "the server is shutting down") -> None:
        """Refuse what still waits (refuse), send what is queued (for CLOSE_LINGER_MS at
        most), then close the socket. Idempotent."""
        if self._stop.is_set():
            return
        self.refuse(self._refusal or message)
        self._stop.set()
        self._thread.join()
        self._to_door.close()
        self._to_loop.close()

    # --- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._to_door.read_fd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                self._to_door.drain()
                self._send_outbox()
                if self._sock in ready:
                    self._read_frames()
                self._refuse_waiting()
            self._refuse_waiting()
            self._send_outbox()
        except Exception as exc:
            log.exception("the client door failed")
            self.failure = f"the server's client thread failed: {exc!r}"
            self._to_loop.wake()
        finally:
            self._sock.close()

    def _send_outbox(self) -> None:
        while self._outbox:
            self._send(*self._outbox.popleft())

    def _send(self, identity: bytes, msg) -> None:
        """One frame to a client; a client whose queue is full (or gone) loses it, the
        thread goes on."""
        try:
            self._sock.send_multipart([identity, protocol.encode(msg, self.key)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not reply to a client: %s", exc)

    def _refuse_waiting(self) -> None:
        if self._refusal is None:
            return
        while self._inbox:
            identity, msg = self._inbox.popleft()
            if not isinstance(msg, Cancel):
                self._outbox.append((identity, Failed(msg.id, self._refusal, "dead")))
        self._send_outbox()

    def _read_frames(self) -> None:
        queued = False
        for _ in range(FRAMES_PER_PASS):
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            queued |= self._admit_frame(parts)
        if queued:
            self._to_loop.wake()

    def _admit_frame(self, parts: list[bytes]) -> bool:
        """Note the client alive; answer a ping; queue anything else (True when queued)."""
        if len(parts) != 2:
            log.warning("dropped a client frame with %d parts", len(parts))
            return False
        identity, frame = parts
        try:
            msg = protocol.decode(frame, self.key)
        except protocol.ProtocolError as exc:
            log.warning("dropped a client frame: %s", exc)
            return False
        self._seen[identity] = time.monotonic()
        if not isinstance(msg, ClientRequest):  # a worker's or a server's message
            log.warning("dropped a client message of type %r", msg.NAME)
            return False
        if not isinstance(msg, Ping):
            self._inbox.append((identity, msg))
            return True
        info = self.info
        self._send(identity, Starting(msg.id) if info is None else Pong(msg.id, info))
        return False
