"""Tool calls and structured outputs through the HTTP front, without a server: a chat body's
tools, tool_choice, response_format and structured_outputs as the engine's arguments
(runtime.api.openai.requests, openai.structured), the app's responses and streams over a fake
engine that answers with a canned text (runtime.api.http.routes, openai.replies). The
server's side of tools: tests/unit/test_chat_tools.py."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
from fastapi.testclient import TestClient

from runtime.api.http.app import create_app
from runtime.api.http.backend import AsyncWaiter, HttpClient
from runtime.api.openai.bodies import ChatCompletionRequest, CompletionRequest
from runtime.api.openai.errors import HttpError
from runtime.api.openai.requests import parse_chat, parse_completion
from runtime.api.openai.tokens import TokenizerSource
from runtime.api.tools.grammar import tool_grammar
from runtime.api.tools.request import parse_tool_request
from runtime.control.protocol import Delta, Failed, Final, Generate
from runtime.errors import ArgumentError
from tests.chat_templates import WEATHER_CALL_TURNS
from tests.http_bodies import validated

pytestmark = pytest.mark.timeout(60)

CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALLS = (
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
HISTORY = [*USER, *WEATHER_CALL_TURNS]


# --- request bodies -----------------------------------------------------------------------
def _chat(**body):
    return parse_chat(validated(ChatCompletionRequest, {"model": "m", "messages": USER, **body}))


def test_tools_go_to_the_template_and_history_calls_are_accepted():
    req = _chat(tools=TOOLS)
    assert req.build_kwargs["tools"] == TOOLS and req.tools is not None
    assert req.tools.choice == "auto" and "structured_outputs" not in req.params
    # "none": the model is not asked to call, but the template still shows the tools (vLLM)
    assert _chat(tools=TOOLS, tool_choice="none").build_kwargs["tools"] == TOOLS
    assert _chat().build_kwargs["tools"] is None
    messages = _chat(messages=HISTORY).build_kwargs["messages"]
    assert messages[1]["content"] == "" and messages[2]["tool_call_id"] == "call_1"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"json": {"type": "object"}}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "A", "schema": SCHEMA},
                }
            },
            {"json": SCHEMA},
        ),
        ({"structured_outputs": {"regex": "[ab]+"}}, {"regex": "[ab]+"}),
        ({"structured_outputs": {"choice": ["x", "y"]}}, {"choice": ["x", "y"]}),
    ],
)
def test_response_format_and_structured_outputs_become_the_engines_argument(body, expected):
    completion = validated(CompletionRequest, {"model": "m", "prompt": "p", **body})
    for req in (_chat(**body), parse_completion(completion)):
        assert req.params.get("structured_outputs") == expected


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"response_format": {"type": "xml"}}, "response_format", "'xml'"),
        ({"response_format": "json"}, "response_format", "expected type"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 1}}},
            "response_format",
            "json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
            "not both",
        ),
        ({"structured_outputs": "json"}, "structured_outputs", "expected an object"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools", "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "'any'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls", "true or false"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "response_format",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ],
)
def test_bad_arguments_are_400s_naming_them(body, param, words):
    with pytest.raises(HttpError) as caught:
        _chat(**body)
    error = caught.value
    assert error.status == 400 and error.param == param, error.body()
    assert error.message.startswith(param) and words in error.message, error.message


def test_the_engines_refusals_name_the_argument_that_constrained():
    refusal = ArgumentError(
        "structured_outputs: the schema cannot be compiled", "structured_outputs"
    )
    error = _chat(response_format={"type": "json_object"}).refusal(refusal)
    assert error.param == "response_format" and error.message.startswith("response_format: ")
    forced = _chat(tools=TOOLS, tool_choice="required").reading_tools(
        "hermes", {"grammar": "root ::= x"}
    )
    assert forced.params["structured_outputs"] == {"grammar": "root ::= x"}
    assert forced.refusal(refusal).param == "tool_choice"
    failed = forced.failure(Failed("r", str(refusal), "value", "structured_outputs"))
    assert failed.status == 400 and failed.param == "tool_choice"
    assert _chat(structured_outputs={"json": {}}).refusal(refusal).param == "structured_outputs"


# --- the app over a fake engine -----------------------------------------------------------
class FakeTokenizer:
    """A Hermes-style chat template (tools add 10 tokens); token i is "<i>"."""

    chat_template = "{{ '<tool_call>' }}"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)

    def encode(self, text):
        return [1] * len(text.split())

    def apply_chat_template(self, messages, tools=None, **_):
        return [0] * (len(messages) + (10 if tools else 0))


class ScriptClient(HttpClient):
    """Answers every request with `text` (each choice), streamed 5 characters a Delta (one
    token each), after HttpClient's own checks (build: SamplingParams')."""

    def __init__(self, text: str):
        self._info = {"model": "/m/tiny", "vocab_size": 1000, "max_seq_len": 64}
        self._ids, self._prefix = itertools.count(), "fake"
        self.text, self.sent = text, []
        self.finish_reason = "stop"  # every choice's finish reason

    def info(self, timeout_s=None):
        return self._info

    def open_async(self, msg: Generate):
        self.sent.append(msg)
        waiter = AsyncWaiter(asyncio.get_running_loop())
        pieces = [self.text[i : i + 5] for i in range(0, len(self.text), 5)]
        outs = []
        for index in range(msg.params["n"]):
            ids = list(range(10, 10 + len(pieces)))
            lps = None if msg.params["logprobs"] is None else [[[t, -1.0]] for t in ids]
            if msg.stream:
                for k, piece in enumerate(pieces):
                    lp = None if lps is None else [lps[k]]
                    waiter.queue.put_nowait(Delta(msg.id, index, [ids[k]], piece, lp))
            out = {
                "index": index,
                "text": self.text,
                "token_ids": ids,
                "finish_reason": self.finish_reason,
            }
            outs.append({**out, "stats": {"prompt_tokens": 3}, "logprobs": lps})
        waiter.queue.put_nowait(Final(msg.id, outs))
        return waiter

    def finish(self, rid, cancel):
        pass


@pytest.fixture
def front(monkeypatch):
    loads: list = []
    tokenizer = FakeTokenizer()
    monkeypatch.setattr(TokenizerSource, "_load", lambda self, info: loads.append(1) or tokenizer)
    client = ScriptClient(CALLS)

    def serve(tool_parser=None):
        return TestClient(create_app(client, "tiny", tool_parser=tool_parser))

    return serve, client, loads, tokenizer


def _post(http, **body) -> dict:
    resp = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _events(http, **body) -> list[dict]:
    resp = http.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": USER, "stream": True, **body}
    )
    assert resp.status_code == 200, resp.text
    lines = [line.removeprefix("data: ") for line in resp.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _joined(events: list[dict], index: int = 0) -> tuple[dict, str | None]:
    """The message a client builds from a stream's chunks of one choice, its finish reason."""
    message: dict = {"role": None, "content": "", "tool_calls": []}
    finish = None
    for event in events:
        for choice in event["choices"]:
            if choice["index"] != index:
                continue
            delta, finish = choice["delta"], choice["finish_reason"] or finish
            message["role"] = delta.get("role", message["role"])
            message["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] == len(message["tool_calls"])
                    function = dict(call["function"])
                    message["tool_calls"].append(
                        {"id": call["id"], "type": call["type"], "function": function}
                    )
                else:
                    args = call["function"]["arguments"]
                    message["tool_calls"][call["index"]]["function"]["arguments"] += args
    return message, finish


def _without_ids(message: dict) -> dict:
    calls = [{**c, "id": None} for c in message.get("tool_calls") or []]
    return {"content": message["content"] or None, "tool_calls": calls}


def test_auto_reads_the_calls_and_streams_them_in_pieces(front):
    serve, client, loads, _ = front
    with serve() as http:
        whole = _post(http, tools=TOOLS, n=2)
        events = _events(http, tools=TOOLS, n=2)
    assert loads == [1]  # the chat template's format, read once
    sent = client.sent[0]
    assert sent.tools == TOOLS and sent.params.get("structured_outputs") is None
    for index in (0, 1):
        choice = whole["choices"][index]
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and message["content"] == "Sure."
        names = [c["function"]["name"] for c in message["tool_calls"]]
        assert names == ["get_weather", "get_time"]
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
        streamed, finish = _joined(events, index)
        assert finish == "tool_calls" and streamed["role"] == "assistant"
        assert _without_ids(streamed) == _without_ids(message)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    args = [d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d]
    assert "" in args and any(len(a) > 1 for a in args)  # a call's head, then its pieces


def test_plain_text_and_tool_choice_none(front):
    serve, client, loads, _ = front
    client.text = "Paris is sunny. <tool_"
    with serve() as http:
        choice = _post(http, tools=TOOLS)["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": client.text}
        assert choice["finish_reason"] == "stop"
        assert _joined(_events(http, tools=TOOLS))[0]["content"] == client.text
        client.text = CALLS  # "none": the text is not read for calls, the tools still shown
        choice = _post(http, tools=TOOLS, tool_choice="none")["choices"][0]
    assert choice["message"]["content"] == CALLS and "tool_calls" not in choice["message"]
    assert client.sent[-1].tools == TOOLS


@pytest.mark.parametrize("choice, finish", [("required", "tool_calls"), (NAMED, "stop")])
def test_forced_choices_send_their_grammar(front, choice, finish):
    pytest.importorskip("xgrammar")
    serve, client, _, _ = front
    client.text = CALLS.removeprefix("Sure.\n")
    with serve() as http:
        whole = _post(http, tools=TOOLS, tool_choice=choice)["choices"][0]
        streamed = _joined(_events(http, tools=TOOLS, tool_choice=choice))
    grammar = tool_grammar(parse_tool_request({"tools": TOOLS, "tool_choice": choice}), "hermes")
    assert grammar is not None
    for sent in client.sent:
        assert sent.params["structured_outputs"] == {"grammar": grammar.ebnf()}
    assert whole["finish_reason"] == finish == streamed[1]
    assert whole["message"]["content"] is None and len(whole["message"]["tool_calls"]) == 2
    assert _without_ids(streamed[0]) == _without_ids(whole["message"])


def test_the_format_is_configured_or_found_else_tools_are_refused(front):
    serve, client, loads, tokenizer = front
    tokenizer.chat_template = "{{ messages }}"  # no tool-call format shows
    with serve() as http:
        resp = http.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": USER, "tools": TOOLS}
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools", resp.text
        assert "no known tool-call format" in resp.json()["error"]["message"]
        assert (
            "tool_calls"
            not in _post(http, tools=TOOLS, tool_choice="none")["choices"][0]["message"]
        )
    loads.clear()
    with serve(tool_parser="hermes") as http:
        assert len(_post(http, tools=TOOLS)["choices"][0]["message"]["tool_calls"]) == 2
    assert loads == []  # a configured format needs no chat template


def test_logprobs_and_usage_stream_with_tool_calls(front):
    serve, client, _, _ = front
    opts = {"include_usage": True, "continuous_usage_stats": True}
    with serve() as http:
        events = _events(http, tools=TOOLS, logprobs=True, stream_options=opts)
    entries = [
        t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["content"]
    ]
    assert len(entries) == -(-len(CALLS) // 5)  # one per token, each once
    assert events[-1]["usage"]["prompt_tokens"] == 3
    assert events[1]["usage"]["prompt_tokens"] == 1 + 10  # the tools count in the prompt
