"""`tandem serve --http 0.0.0.0:PORT --api-key KEY --ssl-keyfile F --ssl-certfile F`, one
launch: a key lets the front listen beyond loopback without --http-allow-remote; the official
`openai` client with the key and the self-signed certificate works over HTTPS, without the
key or with a wrong one every keyed route answers 401, and /tokenize, /detokenize agree with
the tokenizer. (The routes' rules without a server: tests/unit/test_http_keys.py,
tests/unit/test_http_tokenize.py.)"""

from __future__ import annotations

import ssl
import subprocess
import sys

import pytest

from runtime import Client
from tests import certificates, checkpoints, launch

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(240)

MODEL = "target"
KEY = "sk-e2e-0123456789abcdef"


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("pair")
    target = checkpoints.build_with_tokenizer(root / MODEL, seed=0)
    draft = checkpoints.build_near_draft(target, root / "draft", noise=0.05)
    return launch.write_config(root / "c.yaml", draft, target, max_seq_len=128)


def test_bad_key_or_tls_files_are_refused_before_start(config, tmp_path):
    """Exit 2 naming the flag or key, before any process starts (no server, no port)."""
    missing = str(tmp_path / "missing.pem")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(open(config).read() + f"server: {{api_key_file: {missing}}}\n")
    cases = [
        ([config, "--ssl-keyfile", missing, "--ssl-certfile", missing], "--ssl-keyfile: cannot"),
        ([config, "--ssl-certfile", missing], "--ssl-certfile: HTTPS needs --ssl-keyfile"),
        ([str(cfg)], "server.api_key_file: cannot read"),
    ]
    for args, expected in cases:
        res = subprocess.run(
            [sys.executable, "-m", "launcher", "serve", *args, "--http", "127.0.0.1:0"],
            capture_output=True,
            text=True,
            timeout=120,
            env=launch.clean_env(),
        )
        assert res.returncode == 2 and expected in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr and "loading" not in res.stderr


@pytest.fixture(scope="module")
def served(config, tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    keyfile, certfile = certificates.self_signed(root)
    cfg = config
    address = f"ipc://{root}/server.sock"
    port = launch.free_port()
    log_path = root / "serve.log"
    proc = launch.start_serve(
        cfg,
        address,
        *["--http", f"0.0.0.0:{port}", "--api-key", KEY],
        *["--ssl-keyfile", keyfile, "--ssl-certfile", certfile],
        log_path=log_path,
    )
    url = f"https://127.0.0.1:{port}/v1"
    try:
        trust = ssl.create_default_context(cafile=certfile)  # the self-signed certificate
        launch.wait_http(url, proc, log_path, context=trust)
        http = openai.DefaultHttpxClient(verify=trust)
        oai = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120, http_client=http)
        client = Client(address)
        yield {"url": url, "cert": certfile, "oai": oai, "http": http, "client": client}
        client.close()
        oai.close()
        assert launch.stop(proc) == 0, open(log_path).read()[-4000:]
        assert f"HTTP API at https://0.0.0.0:{port}/v1" in open(log_path).read()
    finally:
        if proc.poll() is None:
            launch.stop(proc)
        launch.assert_group_gone(proc.pid)


def _sdk(served, key: str):
    return openai.OpenAI(
        base_url=served["url"], api_key=key, max_retries=0, http_client=served["http"]
    )


def test_sdk_with_the_key_over_https(served):
    oai = served["oai"]
    assert [m.id for m in oai.models.list().data] == [MODEL]
    out = oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0
    )
    ref = served["client"].generate("Once upon a time", max_new_tokens=8, temperature=0)
    assert out.choices[0].text == ref.text
    chunks = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    assert chunks.response.status_code == 200 and any(c.choices for c in chunks)


def test_no_key_or_a_wrong_one_is_401_everywhere(served):
    root = served["url"].removesuffix("/v1")
    http = served["http"]
    for key in ("wrong", KEY + "x"):
        oai = _sdk(served, key)
        with pytest.raises(openai.AuthenticationError) as info:
            oai.models.list()
        assert info.value.body["code"] == "invalid_api_key" and KEY not in str(info.value.body)
        with pytest.raises(openai.AuthenticationError):
            oai.completions.create(model=MODEL, prompt="a", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=2
            )
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
    ]:
        resp = http.request(method, root + path, json={"model": MODEL})
        assert resp.status_code == 401, (path, resp.text)
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    for path in ("/health", "/version", "/metrics"):
        assert http.get(root + path).status_code == 200, path


def test_tokenize_and_detokenize(served):
    from tests.checkpoints import smollm2_tokenizer

    root, auth = served["url"].removesuffix("/v1"), {"Authorization": f"Bearer {KEY}"}
    text = "The quick brown fox jumps over the lazy dog."
    resp = served["http"].post(
        root + "/tokenize", json={"model": MODEL, "prompt": text}, headers=auth
    )
    assert resp.status_code == 200, resp.text
    out = resp.json()
    ids = list(smollm2_tokenizer().encode(text))
    assert out["tokens"] == ids and out["count"] == len(ids) and out["max_model_len"] == 128
    back = served["http"].post(root + "/detokenize", json={"tokens": ids}, headers=auth)
    assert back.json() == {"prompt": text}
