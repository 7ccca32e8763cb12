"""The HTTP front's /tokenize and /detokenize (vLLM's shapes) without a server: the app over
a fake client, with SmolLM2's real tokenizer as the server's. /tokenize gives the ids the
server would generate from (a text as Orchestrator.encode, a conversation as encode_chat),
/detokenize inverts it, and bad bodies are 400s naming the argument."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from runtime.api.http.app import create_app
from runtime.api.openai.tokens import TokenizerSource
from runtime.serving.chat import render_chat
from tests.checkpoints import smollm2_tokenizer

pytestmark = pytest.mark.timeout(120)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is speculative decoding?"},
]


class _FakeClient:
    def __init__(self, has_tokenizer: bool = True):
        self._info = {
            "model": "/m/tiny",
            "vocab_size": 49152,
            "max_seq_len": 256,
            "has_tokenizer": has_tokenizer,
        }


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture
def http(monkeypatch, tokenizer):
    monkeypatch.setattr(TokenizerSource, "_load", lambda self, info: tokenizer)
    with TestClient(create_app(_FakeClient(), "tiny")) as client:
        yield client


def _post(http, path: str, status: int = 200, **body) -> dict:
    resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    return resp.json()


def test_tokenize_a_text_is_the_servers_encoding_and_detokenize_inverts_it(http, tokenizer):
    text = "Once upon a time, in a land far away"
    out = _post(http, "/tokenize", model="tiny", prompt=text)
    ids = list(tokenizer.encode(text))
    assert out == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    assert _post(http, "/detokenize", model="tiny", tokens=ids) == {"prompt": text}
    assert _post(http, "/detokenize", tokens=[]) == {"prompt": ""}


def test_tokenize_options(http, tokenizer):
    text = "Hello world"
    out = _post(http, "/tokenize", prompt=text, return_token_strs=True)  # model is optional
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    plain = _post(http, "/tokenize", prompt=text, add_special_tokens=False)["tokens"]
    assert plain == list(tokenizer.encode(text, add_special_tokens=False))


def test_tokenize_a_conversation_is_the_servers_chat_prompt(http, tokenizer):
    out = _post(http, "/tokenize", model="tiny", messages=MESSAGES)
    assert out["tokens"] == render_chat(tokenizer, MESSAGES) and out["count"] > 10
    text = _post(http, "/detokenize", tokens=out["tokens"])["prompt"]
    assert text == render_chat(tokenizer, MESSAGES, tokenize=False)
    bare = _post(http, "/tokenize", messages=MESSAGES, add_generation_prompt=False)["tokens"]
    assert bare == render_chat(tokenizer, MESSAGES, add_generation_prompt=False)
    assert len(bare) < out["count"] and out["tokens"][: len(bare)] == bare


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "messages"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "temperature": 0}, "temperature"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/tokenize", {"messages": [{"content": "x"}]}, "messages"),
        ("/tokenize", {"messages": MESSAGES, "tools": "x"}, "tools"),
        (
            "/tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            "continue_final_message",
        ),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [49152]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": [1], "prompt": "a"}, "prompt"),
    ],
)
def test_bad_bodies_are_400_naming_the_argument(http, path, body, param):
    error = _post(http, path, 400, **body)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_another_model_is_404(http):
    error = _post(http, "/tokenize", 404, model="other", prompt="a")["error"]
    assert error["code"] == "model_not_found"
    assert _post(http, "/detokenize", 404, model="other", tokens=[1])["error"]["param"] == "model"


def test_without_a_tokenizer(monkeypatch):
    monkeypatch.setattr(TokenizerSource, "_load", lambda self, info: None)
    with TestClient(create_app(_FakeClient(has_tokenizer=False), "tiny")) as http:
        assert "no tokenizer" in _post(http, "/tokenize", 400, prompt="a")["error"]["message"]
    with TestClient(create_app(_FakeClient(), "tiny")) as http:  # the front cannot load it
        error = _post(http, "/detokenize", 503, tokens=[1])["error"]
        assert error["code"] == "tokenizer_unavailable"
