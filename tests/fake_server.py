"""A stand-in for a tandem server in client tests: a ROUTER socket that answers pings with a
given `info` and nothing else."""

from __future__ import annotations

import threading

import zmq

from runtime.control import protocol


class PingServer:
    """Answers pings at `address` (a random loopback TCP port when None; `.address` says
    which) with `info`, on a thread of its own, until close()."""

    def __init__(self, info: dict, address: str | None = None):
        self.info = info
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if address is None:
            address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        else:
            self.sock.bind(address)
        self.address = address
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            identity, frame = self.sock.recv_multipart()
            msg = protocol.decode(frame)
            if isinstance(msg, protocol.Ping):
                reply = protocol.Pong(msg.id, self.info)
                self.sock.send_multipart([identity, protocol.encode(reply)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.context.term()
