"""A self-signed certificate for tests of the HTTP front's TLS, made with the `openssl`
command (the test is skipped where there is none)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def self_signed(folder: Path, name: str = "") -> tuple[str, str]:
    """(key file, certificate file), PEM, for localhost and 127.0.0.1, valid for a day."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    key, cert = folder / f"key{name}.pem", folder / f"cert{name}.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(key), str(cert)
