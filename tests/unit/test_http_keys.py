"""The HTTP front's API key and TLS files without a server: every route but /health,
/metrics and /version answers 401 (OpenAI's error object, nothing of the key) without
`Authorization: Bearer KEY` or with a wrong one (runtime.api.http.guard over the real app);
where the key comes from, and what is refused before anything starts
(runtime.api.http.access, launcher.cli_checks)."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from launcher.cli_checks import config_from_args, serve_endpoints
from launcher.cli_parser import build_parser
from runtime.api.http.access import (
    API_KEY_ENV,
    HttpAccess,
    api_key_given,
    check_tls,
    http_access,
)
from runtime.api.http.app import create_app
from runtime.api.http.guard import OPEN_PATHS
from runtime.config import ConfigError, default_config
from runtime.version import installed_version
from tests.certificates import self_signed

pytestmark = pytest.mark.timeout(60)

KEY = "sk-tandem-test-0123456789"


class _FakeClient:
    """What the open routes and /v1/models read of their HttpClient."""

    def __init__(self):
        self._info = {"model": "/m/tiny", "vocab_size": 100, "max_seq_len": 64}

    def metrics(self, timeout_s=None):
        return "tandem:num_requests_running 0\n"

    def info(self, timeout_s=None):  # /health pings the server
        return dict(self._info)


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)


@pytest.fixture
def keyed():
    app = create_app(_FakeClient(), "tiny", api_key=KEY)
    with TestClient(app) as http:
        yield http, app


def _guarded(app) -> list[tuple[str, str]]:
    """(method, path) of every route the key guards; a sample path for a path parameter."""
    out = []
    for route in app.routes:
        if route.path in OPEN_PATHS:
            continue
        path = route.path.replace("{name:path}", "tiny")
        out += [(method, path) for method in sorted(route.methods - {"HEAD"})]
    return out


def test_every_route_but_the_open_ones_is_guarded(keyed):
    http, app = keyed
    routes = _guarded(app)
    paths = {path for _, path in routes}
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions"} <= paths
    assert {"/tokenize", "/detokenize", "/openapi.json", "/docs"} <= paths
    for method, path in routes + [("GET", "/no/such/route"), ("POST", "/v1/no-such")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            resp = http.request(method, path, headers=headers, json={"model": "tiny"})
            assert resp.status_code == 401, (method, path, headers, resp.text)
            error = resp.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "invalid_api_key" and KEY not in resp.text
            assert resp.headers["www-authenticate"] == "Bearer"


def test_the_right_key_passes(keyed):
    http, _ = keyed
    for scheme in ("Bearer", "bearer"):
        resp = http.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert resp.status_code == 200 and resp.json()["data"][0]["id"] == "tiny"
    auth = {"Authorization": f"Bearer {KEY}"}
    assert "/v1/completions" in http.get("/openapi.json", headers=auth).json()["paths"]
    assert http.get("/docs", headers=auth).status_code == 200
    for wrong in (KEY[:-1], KEY + "x", KEY.upper(), f"Basic {KEY}"):
        header = wrong if wrong.startswith("Basic") else f"Bearer {wrong}"
        assert http.get("/v1/models", headers={"Authorization": header}).status_code == 401


def test_open_routes_need_no_key(keyed):
    http, _ = keyed
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/version").json() == {"version": installed_version() or "unknown"}
    resp = http.get("/metrics")
    assert resp.status_code == 200 and "tandem:num_requests_running" in resp.text


def test_without_a_key_nothing_is_guarded():
    with TestClient(create_app(_FakeClient(), "tiny")) as http:
        assert http.get("/v1/models").status_code == 200
        assert http.get("/openapi.json").status_code == 200


# --- where the key comes from ---------------------------------------------------------------
def _key_file(tmp_path, text: str = KEY, mode: int = 0o600) -> str:
    path = tmp_path / "api-key"
    path.write_text(text + "\n")
    path.chmod(mode)
    return str(path)


def test_key_precedence_flag_env_file(tmp_path, monkeypatch):
    path = _key_file(tmp_path, "from-file")
    assert http_access(None).api_key is None
    assert http_access(None, path).api_key == "from-file"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert http_access(None, path).api_key == "from-env"
    assert http_access("from-flag", path).api_key == "from-flag"
    monkeypatch.setenv(API_KEY_ENV, "")  # empty: unset
    assert http_access(None, path).api_key == "from-file"


def test_key_never_shows_in_a_repr():
    assert KEY not in repr(HttpAccess(KEY)) and KEY not in str(HttpAccess(KEY))


@pytest.mark.parametrize(
    "text, mode, expected",
    [
        (KEY, 0o644, "chmod 600"),
        ("", 0o600, "empty"),
        ("two words", 0o600, "printable ASCII"),
        ("clé", 0o600, "printable ASCII"),
    ],
)
def test_key_file_rules(tmp_path, text, mode, expected):
    with pytest.raises(ConfigError, match=expected) as info:
        http_access(None, _key_file(tmp_path, text, mode))
    assert info.value.key == "server.api_key_file"


def test_missing_key_file_names_the_config_key(tmp_path):
    with pytest.raises(ConfigError, match="cannot read") as info:
        http_access(None, str(tmp_path / "missing"))
    assert info.value.key == "server.api_key_file"


@pytest.mark.parametrize("flag", ["", "a b", "k\u00e9y"])
def test_bad_flag_key_is_refused(flag):
    with pytest.raises(ValueError, match="--api-key"):
        http_access(flag)


# --- TLS files -------------------------------------------------------------------------------
def test_tls_files_are_checked_before_anything_starts(tmp_path):
    key, cert = self_signed(tmp_path)
    access = http_access(None, None, key, cert)
    assert access.scheme == "https"
    assert access.uvicorn_kwargs() == {"ssl_keyfile": key, "ssl_certfile": cert}
    assert HttpAccess().scheme == "http" and HttpAccess().uvicorn_kwargs() == {}
    other_key, _ = self_signed(tmp_path, "2")
    cases = [
        ((key, None), "--ssl-keyfile: HTTPS needs --ssl-certfile"),
        ((None, cert), "--ssl-certfile: HTTPS needs --ssl-keyfile"),
        ((str(tmp_path / "none.pem"), cert), "--ssl-keyfile: cannot read"),
        ((key, str(tmp_path / "none.pem")), "--ssl-certfile: cannot read"),
        ((other_key, cert), "do not load"),
        ((cert, cert), "do not load"),
    ]
    for (keyfile, certfile), expected in cases:
        with pytest.raises(ValueError, match=expected):
            check_tls(keyfile, certfile)


# --- serve's flags ---------------------------------------------------------------------------
def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_a_key_allows_a_non_loopback_http(tmp_path, monkeypatch):
    config = default_config()
    with pytest.raises(ValueError) as info:
        serve_endpoints(_serve_args("--http", "0.0.0.0:8000"), config)
    assert "--api-key" in str(info.value) and "--http-allow-remote" in str(info.value)
    assert serve_endpoints(_serve_args("--http", "0.0.0.0:8000", "--http-allow-remote"), config)
    http, _ = serve_endpoints(_serve_args("--http", "0.0.0.0:8000", "--api-key", KEY), config)
    assert http == ("0.0.0.0", 8000)
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert api_key_given(None, None)
    assert serve_endpoints(_serve_args("--http", "0.0.0.0:8000"), config)[0] == http


@pytest.mark.parametrize(
    "flag", [["--api-key", KEY], ["--ssl-keyfile", "k"], ["--tool-call-parser", "hermes"]]
)
def test_http_flags_need_http(flag):
    with pytest.raises(ValueError, match=f"{flag[0]}: .*--http"):
        serve_endpoints(_serve_args(*flag), default_config())


def test_tool_call_parser_sets_server_tool_parser():
    args = _serve_args("--tool-call-parser", "llama3_json", "--http", "8000")
    assert config_from_args(args, check_devices=False).server.tool_parser == "llama3_json"
    assert config_from_args(_serve_args(), check_devices=False).server.tool_parser is None
    with pytest.raises(SystemExit):
        _serve_args("--tool-call-parser", "nope")
