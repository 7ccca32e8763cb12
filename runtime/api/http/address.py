"""Where the HTTP endpoints listen and how they are reached: `HOST:PORT` flags (loopback
unless allowed otherwise), their listening sockets, and the URLs and addresses derived from
them. Used by the OpenAI-compatible front (runtime/api/http/app.py) and `tandem serve`."""

from __future__ import annotations

import ipaddress
import re
import socket


def parse_http_address(
    text: str,
    allow_remote: bool = False,
    flag: str = "--http",
    what: str = "the HTTP API",
    remote_needs: str | None = None,
) -> tuple[str, int]:
    """'HOST:PORT', '[V6]:PORT' or 'PORT' (host 127.0.0.1) -> (host, port). A host that is
    not loopback is refused unless allow_remote. Errors are ValueErrors naming `flag` (the
    option that gave the address; `what` is what it serves; `remote_needs`: what would allow
    a remote host, default FLAG-allow-remote)."""
    text = text.strip()
    match = re.fullmatch(r"(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:\[\]]*)):(?P<port>\d+)", text)
    if match:
        host = match.group("v6") or match.group("host") or "127.0.0.1"
        port = int(match.group("port"))
    elif text.isdigit():
        host, port = "127.0.0.1", int(text)
    else:
        raise ValueError(f"{flag}: expected HOST:PORT, got {text!r}")
    if not 0 <= port <= 65535:
        raise ValueError(f"{flag}: port {port} is out of range")
    if not allow_remote and not is_loopback(host):
        raise ValueError(
            f"{flag}: {host} is not a loopback address; {what} has no "
            f"authentication, so binding elsewhere needs {remote_needs or flag + '-allow-remote'}"
        )
    return host, port


def is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(
        ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos
    )


def bind_http(host: str, port: int) -> socket.socket:
    """A listening TCP socket (bound before anything else starts, so a taken port is an
    early error and port 0 picks a free one)."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(256)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def connect_address(address: str) -> str:
    """Where a local client reaches a server bound at `address` (a wildcard host becomes
    loopback)."""
    match = re.fullmatch(r"tcp://(\*|0\.0\.0\.0|\[::\]|\[\*\]):(\d+)", address)
    if match:
        host = "[::1]" if match.group(1).startswith("[") else "127.0.0.1"
        return f"tcp://{host}:{match.group(2)}"
    return address


def socket_url(sock: socket.socket, scheme: str = "http") -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}/v1"
