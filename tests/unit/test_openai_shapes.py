"""The HTTP front's OpenAI shapes of logprobs, echo, n and usage without a server: the app
(runtime.api.http.app.create_app) over a client whose engine is faked (its replies are made
from the request's own arguments), with a fake tokenizer in place of the server's."""

from __future__ import annotations

import asyncio
import itertools
import json
import math

import pytest
from fastapi.testclient import TestClient

from runtime.api.http.app import create_app
from runtime.api.http.backend import AsyncWaiter, HttpClient
from runtime.api.openai.logprobs import MIN_LOGPROB
from runtime.api.openai.reply_models import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
)
from runtime.api.openai.tokens import TokenizerSource, TokenStrings
from runtime.control.protocol import Delta, Final, Generate

pytestmark = pytest.mark.timeout(60)


class FakeTokenizer:
    """Id 0 is "<s>" (special, put before every prompt); id i is " t{i}"; a word is the id
    of its length + 10."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(("" if skip_special_tokens else "<s>") if i == 0 else f" t{i}" for i in ids)

    def encode(self, text):
        return [0] + [len(word) + 10 for word in text.split()]

    def apply_chat_template(self, messages, **_):
        return [0] + [1] * len(messages)


TOK = FakeTokenizer()


def _entry(token: int, top: int) -> list:
    """The server's logprobs of one token: the chosen first, then its top `top`."""
    alts = [[token + 1, -0.5], [token, -1.0], [token + 2, -math.inf]][:top]
    return [[token, -1.0], *[a for a in alts if a[0] != token]]


def _outputs(msg: Generate) -> list[dict]:
    """What a server answers: prompt p's sample j generates ids 20 + j, 21 + j, ..."""
    rows = msg.prompt_ids or [TOK.encode(p) for p in msg.prompts or []]
    if msg.messages is not None:
        rows = [TOK.apply_chat_template(msg.messages)]
    params, outs = msg.params, []
    for p, row in enumerate(rows):
        for j in range(params["n"]):
            ids = [20 + j + k for k in range(params["max_new_tokens"])]
            out = {"index": p * params["n"] + j, "text": TOK.decode(ids), "token_ids": ids}
            out.update(finish_reason="length", stats={"prompt_tokens": len(row)})
            if params["logprobs"] is not None:
                out["logprobs"] = [_entry(t, params["logprobs"]) for t in ids]
            if params["prompt_logprobs"] is not None:
                rest = [_entry(t, params["prompt_logprobs"]) for t in row[1:]]
                out["prompt_logprobs"] = [None, *rest]
            outs.append(out)
    return outs


def _replies(msg: Generate) -> list:
    outs = _outputs(msg)
    if not msg.stream:
        return [Final(msg.id, outs)]
    deltas = []
    for out in outs:
        for k, token in enumerate(out["token_ids"]):
            lps = None if "logprobs" not in out else [out["logprobs"][k]]
            deltas.append(Delta(msg.id, out["index"], [token], TOK.decode([token]), lps))
    return [*deltas, Final(msg.id, outs)]


class FakeClient(HttpClient):
    """HttpClient's own argument checks (build), a fake engine behind them."""

    def __init__(self):  # no socket, no I/O thread
        self._info = {"model": "/m/tiny", "vocab_size": 1000, "max_seq_len": 64}
        self._ids, self._prefix = itertools.count(), "fake"
        self.sent: list[Generate] = []

    def info(self, timeout_s=None):
        return self._info

    def open_async(self, msg):
        self.sent.append(msg)
        waiter = AsyncWaiter(asyncio.get_running_loop())
        for reply in _replies(msg):
            waiter.queue.put_nowait(reply)
        return waiter

    def finish(self, rid, cancel):
        pass


@pytest.fixture
def app(monkeypatch):
    loads = []
    monkeypatch.setattr(TokenizerSource, "_load", lambda self, info: loads.append(1) or TOK)
    client = FakeClient()
    with TestClient(create_app(client, "tiny")) as http:
        yield http, client, loads


def _post(http, path: str, **body) -> dict:
    resp = http.post(f"/v1/{path}", json={"model": "tiny", **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _events(http, path: str, **body) -> list[dict]:
    resp = http.post(f"/v1/{path}", json={"model": "tiny", "stream": True, **body})
    assert resp.status_code == 200, resp.text
    lines = [line.removeprefix("data: ") for line in resp.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completion_logprobs_legacy_shape(app):
    http, client, loads = app
    out = _post(http, "completions", prompt="a bb", max_tokens=3, logprobs=2, temperature=0)
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == [" t20", " t21", " t22"]
    assert lp["token_logprobs"] == [-1.0, -1.0, -1.0]
    assert lp["top_logprobs"][0] == {" t20": -1.0, " t21": -0.5}
    assert lp["text_offset"] == [0, 4, 8]
    assert client.sent[-1].params["logprobs"] == 2 and loads == [1]
    three = _post(http, "completions", prompt="a", max_tokens=1, logprobs=3)
    top = three["choices"][0]["logprobs"]["top_logprobs"][0]
    assert top == {" t20": -1.0, " t21": -0.5, " t22": MIN_LOGPROB}  # -inf: vLLM's -9999.0
    assert loads == [1]  # loaded once


def test_no_tokenizer_without_logprobs(app):
    http, _, loads = app
    out = _post(http, "completions", prompt="a", max_tokens=2, echo=True)
    assert out["choices"][0]["text"] == "a t20 t21" and out["choices"][0]["logprobs"] is None
    assert loads == []


def test_echo_of_token_id_rows_as_lm_eval_asks(app):
    http, client, _ = app
    body = dict(prompt=[[0, 5, 6], [0, 7]], echo=True, logprobs=1, temperature=0)
    out = _post(http, "completions", max_tokens=0, **body)
    assert client.sent[-1].params["prompt_logprobs"] == 1
    first, second = (c["logprobs"] for c in out["choices"])
    assert out["choices"][0]["text"] == " t5 t6"  # the prompt, its special tokens skipped
    assert first["tokens"] == ["<s>", " t5", " t6"] and second["tokens"] == ["<s>", " t7"]
    assert first["token_logprobs"] == [None, -1.0, -1.0]
    assert first["top_logprobs"] == [None, {" t5": -1.0, " t6": -0.5}, {" t6": -1.0, " t7": -0.5}]
    assert first["text_offset"] == [0, 3, 6]
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    one = _post(http, "completions", max_tokens=1, **body)["choices"][1]
    assert one["text"] == " t7 t20" and one["logprobs"]["tokens"] == ["<s>", " t7", " t20"]
    assert one["logprobs"]["token_logprobs"][-1] == -1.0


def test_echo_of_a_text_prompt_with_logprobs(app):
    http, _, _ = app
    out = _post(http, "completions", prompt="a bb", max_tokens=1, echo=True, logprobs=0)
    choice = out["choices"][0]
    assert choice["text"] == "a bb t20"
    assert choice["logprobs"]["tokens"] == ["<s>", " t11", " t12", " t20"]
    assert choice["logprobs"]["top_logprobs"][1:] == [
        {" t11": -1.0},
        {" t12": -1.0},
        {" t20": -1.0},
    ]


def test_n_choices_and_usage_counts_each_prompt_once(app):
    http, _, _ = app
    out = _post(http, "completions", prompt=["a", "b c"], n=2, max_tokens=2, seed=3)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == [" t20 t21", " t21 t22"] * 2
    assert out["usage"] == {"prompt_tokens": 2 + 3, "completion_tokens": 8, "total_tokens": 13}
    chat = _post(http, "chat/completions", messages=[{"role": "user", "content": "x"}], n=3)
    assert [c["index"] for c in chat["choices"]] == [0, 1, 2]
    assert chat["usage"]["prompt_tokens"] == 2 and chat["usage"]["completion_tokens"] == 48


def test_chat_logprobs_shape(app):
    http, _, _ = app
    messages = [{"role": "user", "content": "x"}]
    out = _post(http, "chat/completions", messages=messages, max_tokens=2, logprobs=True)
    content = out["choices"][0]["logprobs"]["content"]
    assert content[0] == {
        "token": " t20",
        "logprob": -1.0,
        "bytes": [32, 116, 50, 48],
        "top_logprobs": [],
    }
    out = _post(
        http, "chat/completions", messages=messages, max_tokens=2, logprobs=True, top_logprobs=2
    )
    top = out["choices"][0]["logprobs"]["content"][1]["top_logprobs"]
    assert [(t["token"], t["logprob"]) for t in top] == [(" t22", -0.5), (" t21", -1.0)]
    assert top[0]["bytes"] == list(b" t22")


def test_streamed_completion_logprobs_and_continuous_usage(app):
    http, _, _ = app
    whole = _post(http, "completions", prompt="a", max_tokens=3, logprobs=1)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _events(http, "completions", prompt="a", max_tokens=3, logprobs=1, stream_options=opts)
    pieces = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert len(pieces) == 3
    joined = {k: sum((p["logprobs"][k] for p in pieces), []) for k in pieces[0]["logprobs"]}
    assert joined == whole["choices"][0]["logprobs"]
    assert [c["usage"]["completion_tokens"] for c in chunks[:3]] == [1, 2, 3]
    assert all(c["usage"]["prompt_tokens"] == 2 for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5


def test_streamed_echo_and_chat_roles_per_choice(app):
    http, _, _ = app
    chunks = _events(http, "completions", prompt=["a", "b"], n=2, max_tokens=1, echo=True)
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks[:4]] == [
        (0, "a"),
        (1, "a"),
        (2, "b"),
        (3, "b"),
    ]
    messages = [{"role": "user", "content": "x"}]
    chunks = _events(http, "chat/completions", messages=messages, n=2, max_tokens=1, logprobs=True)
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant"] * 2
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    with_lp = [c["choices"][0] for c in chunks if c["choices"][0]["logprobs"]]
    assert [c["logprobs"]["content"][0]["token"] for c in with_lp] == [" t20", " t21"]


def test_bad_arguments_are_400_and_the_front_keeps_serving(app):
    http, _, _ = app
    for body, param in [
        ({"prompt": "a", "logprobs": 21}, "logprobs"),
        ({"prompt": "a", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"prompt": "a", "logit_bias": {"a": 1}}, "logit_bias"),
        ({"prompt": "a", "presence_penalty": 9}, "presence_penalty"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
    ]:
        resp = http.post("/v1/completions", json={"model": "tiny", **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    resp = http.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 1},
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_logprobs"
    assert _post(http, "completions", prompt="a", max_tokens=1)["choices"][0]["text"] == " t20"


@pytest.mark.parametrize(
    "path, body",
    [
        ("completions", dict(prompt=["a", "b"], n=2, max_tokens=2, logprobs=2)),
        ("completions", dict(prompt=[[0, 5]], max_tokens=1, echo=True, logprobs=1)),
        ("chat/completions", dict(messages=[{"role": "user", "content": "x"}], max_tokens=2)),
        (
            "chat/completions",
            dict(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2),
        ),
    ],
)
def test_answers_and_chunks_are_their_reply_models(app, path, body):
    """What the shapes make is what /openapi.json says (openai_replies), key for key: a
    whole answer (served through its response_model) and every chunk of its stream."""
    http, _, _ = app
    whole, chunk = (
        (Completion, CompletionChunk)
        if path == "completions"
        else (ChatCompletion, ChatCompletionChunk)
    )
    out = _post(http, path, **body)
    assert whole.model_validate(out).model_dump(exclude_unset=True) == out
    if body.get("echo"):  # streaming an echo with logprobs is refused
        return
    for event in _events(http, path, stream_options={"include_usage": True}, **body):
        assert chunk.model_validate(event).model_dump(exclude_unset=True) == event


def test_token_strings_without_a_tokenizer(tmp_path):
    source = TokenizerSource(str(tmp_path / "missing"))
    strings = asyncio.run(source.get({}))
    assert strings(5) == "token_id:5" and strings.decode([5]) == ""
    assert TokenStrings(TOK)(0) == "<s>"  # special tokens are shown
