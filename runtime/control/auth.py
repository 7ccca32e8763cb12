"""Control-plane authentication: an HMAC-SHA256 of every frame under a shared key read from a
file. Required whenever a socket listens beyond loopback (a non-loopback `server.address`, or
TANDEM_CONTROL_HOST for the workers' control plane); optional otherwise for clients. The
workers' control plane is always authenticated: without a key file, rank 0 makes a random key
per launch (launch_key) and hands it to the workers over torch.distributed."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import socket

MAC_BYTES = 32
MIN_KEY_BYTES = 16
LAUNCH_KEY_BYTES = 32


class AuthError(ValueError):
    """Bad or missing key material."""


def host_of(address: str) -> str | None:
    """The host of a tcp:// ZeroMQ address (None for ipc://, which is local by nature)."""
    if not address.startswith("tcp://"):
        return None
    host = address[len("tcp://") :].rsplit(":", 1)[0]
    return host.strip("[]")


def is_loopback(address: str) -> bool:
    host = host_of(address)
    if host is None or host == "localhost":
        return True
    if host == "*":
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except (OSError, ValueError):
            return False


def load_key(path: str) -> bytes:
    """The key in `path` (leading/trailing whitespace stripped); at least 16 bytes."""
    try:
        with open(path, "rb") as fh:
            key = fh.read().strip()
    except OSError as exc:
        raise AuthError(f"cannot read key file {path}: {exc.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise AuthError(
            f"key file {path} holds {len(key)} bytes; use at least "
            f"{MIN_KEY_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > {path}`)"
        )
    if os.stat(path).st_mode & 0o077:
        raise AuthError(f"key file {path} is readable by others; chmod 600 it")
    return key


def sign(payload: bytes, key: bytes | None) -> bytes:
    if key is None:
        return payload
    return hmac.new(key, payload, hashlib.sha256).digest() + payload


def verify(frame: bytes, key: bytes | None) -> bytes:
    """The payload of a signed frame; AuthError when the signature does not match."""
    if key is None:
        return frame
    mac, payload = frame[:MAC_BYTES], frame[MAC_BYTES:]
    expected = hmac.new(key, payload, hashlib.sha256).digest()
    if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, expected):
        raise AuthError("frame signature does not match the shared key")
    return payload


CONTROL_KEY_ENV = "TANDEM_AUTH_KEY_FILE"
_control_key: list[bytes | None] = []


def control_key() -> bytes | None:
    """The workers' control-plane key: the file named by TANDEM_AUTH_KEY_FILE (the same file
    on every rank), or None. Read once per process."""
    if not _control_key:
        path = os.environ.get(CONTROL_KEY_ENV)
        _control_key.append(load_key(path) if path else None)
    return _control_key[0]


def launch_key() -> bytes:
    """A fresh random key for one launch's control plane, when no key file is configured:
    rank 0 hands it to the workers over the world group (parallel.groups.broadcast_control)."""
    return secrets.token_bytes(LAUNCH_KEY_BYTES)


def use_control_key(key: bytes) -> None:
    """From now on control_key() is `key` (a worker, given rank 0's launch key)."""
    _control_key[:] = [key]


def check_control_bind(address: str) -> None:
    """A control plane beyond loopback must be authenticated."""
    if not is_loopback(address) and control_key() is None:
        raise AuthError(
            f"control sockets at {address} would listen beyond loopback; set "
            f"{CONTROL_KEY_ENV} to a shared key file on every rank"
        )
