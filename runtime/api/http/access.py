"""Who may use the HTTP front and how it is reached, settled before anything starts: its API
key and its TLS files (docs/serving.md, "Keys, TLS and open endpoints").

The API key is the HTTP clients' bearer token (`Authorization: Bearer KEY`, checked by
runtime/api/http/guard.py). It comes from `--api-key KEY`, else the environment's
TANDEM_API_KEY, else the file that the config's `server.api_key_file` names. It is not
`server.auth_key_file`: that one is the HMAC key that signs the ZeroMQ frames between clients
and the server (runtime/control/auth.py), which HTTP clients never see.

TLS: `--ssl-keyfile` and `--ssl-certfile` (PEM) make uvicorn serve HTTPS; both or neither, and
they must load (and match) here, so a missing, unreadable or mismatched file is a usage error
before any process starts."""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass, field

from runtime.errors import ConfigError

API_KEY_ENV = "TANDEM_API_KEY"
KEY_FILE_KEY = "server.api_key_file"
# what a non-loopback --http needs (runtime.api.http.address.parse_http_address's message)
REMOTE_NEEDS = f"an API key (--api-key, {API_KEY_ENV} or {KEY_FILE_KEY}) or --http-allow-remote"


@dataclass(frozen=True)
class HttpAccess:
    """The front's key (None: open to anyone who reaches it) and TLS files (None: plain
    HTTP). The key never shows in a repr."""

    api_key: str | None = field(default=None, repr=False)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def uvicorn_kwargs(self) -> dict:
        """uvicorn.Config's TLS arguments."""
        if not self.tls:
            return {}
        return {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile}


def add_access_flags(parser: argparse.ArgumentParser) -> None:
    """--api-key, --ssl-keyfile, --ssl-certfile (`tandem serve` has the same)."""
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"HTTP clients must send `Authorization: Bearer KEY` to every route but /health, "
        f"/metrics and /version; a key also allows a non-loopback --http. A key on the command "
        f"line shows in `ps`: prefer ${API_KEY_ENV} (or `tandem serve`'s {KEY_FILE_KEY}) "
        f"(default: ${API_KEY_ENV}, else {KEY_FILE_KEY}, else no key)",
    )
    parser.add_argument(
        "--ssl-keyfile",
        default=None,
        metavar="FILE",
        help="serve HTTPS with this PEM private key (with --ssl-certfile; default: plain HTTP)",
    )
    parser.add_argument(
        "--ssl-certfile",
        default=None,
        metavar="FILE",
        help="serve HTTPS with this PEM certificate (chain) (with --ssl-keyfile; default: "
        "plain HTTP)",
    )


def api_key_given(flag: str | None, key_file: str | None) -> bool:
    """Whether a key is set (`--api-key`, TANDEM_API_KEY or server.api_key_file), without
    reading it: a keyed front may listen beyond loopback."""
    return flag is not None or bool(os.environ.get(API_KEY_ENV)) or key_file is not None


def http_access(
    flag: str | None,
    key_file: str | None = None,
    ssl_keyfile: str | None = None,
    ssl_certfile: str | None = None,
) -> HttpAccess:
    """The checked HttpAccess of `--api-key` (`flag`), TANDEM_API_KEY, server.api_key_file
    (`key_file`), `--ssl-keyfile` and `--ssl-certfile`: ValueErrors naming the flag, a
    ConfigError naming server.api_key_file."""
    check_tls(ssl_keyfile, ssl_certfile)
    return HttpAccess(resolve_api_key(flag, key_file), ssl_keyfile, ssl_certfile)


def resolve_api_key(flag: str | None, key_file: str | None) -> str | None:
    """The key, by precedence: the flag, the environment, the file; None when none is set."""
    if flag is not None:
        return check_api_key(flag, "--api-key")
    env = os.environ.get(API_KEY_ENV)
    if env:
        return check_api_key(env, API_KEY_ENV)
    if key_file is not None:
        return load_api_key(key_file)
    return None


def check_api_key(key: str, source: str) -> str:
    """A key a client can send in an HTTP header: printable ASCII without spaces."""
    if not key:
        raise ValueError(f"{source}: the API key is empty")
    if not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError(
            f"{source}: the API key must be printable ASCII without spaces (it travels in "
            f"the Authorization header)"
        )
    return key


def load_api_key(path: str) -> str:
    """The key in the file `path` (surrounding whitespace stripped), which only its owner may
    read (as server.auth_key_file); a ConfigError naming server.api_key_file."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read().strip()
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigError(KEY_FILE_KEY, f"cannot read {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise ConfigError(KEY_FILE_KEY, f"{path} is readable by others; chmod 600 it")
    text = raw.decode("ascii", errors="replace")  # a non-ASCII byte is refused below
    try:
        return check_api_key(text, path)
    except ValueError as exc:
        raise ConfigError(KEY_FILE_KEY, str(exc)) from None


def check_tls(keyfile: str | None, certfile: str | None) -> None:
    """Both files or neither; each readable; the pair loads as a server's certificate chain
    (an encrypted key is refused: there is no passphrase to give)."""
    if (keyfile is None) != (certfile is None):
        flags = ["--ssl-keyfile", "--ssl-certfile"]
        given, missing = flags if certfile is None else flags[::-1]
        raise ValueError(f"{given}: HTTPS needs {missing} too")
    if keyfile is None or certfile is None:
        return
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ValueError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile, password=_no_passphrase)
    except (ssl.SSLError, ValueError) as exc:
        raise ValueError(
            f"--ssl-certfile/--ssl-keyfile: {certfile} and {keyfile} do not load as a PEM "
            f"certificate and its unencrypted private key: {exc}"
        ) from None


def _no_passphrase() -> str:
    raise ValueError("the private key is encrypted")
