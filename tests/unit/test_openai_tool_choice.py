"""A forced tool choice ("required", a named function) on any model: where the chat template
shows no known tool-call format (and no server.tool_parser is set), the grammar forces the
call's JSON (runtime.api.tools.parsers' JSON_CALLS: a named function's arguments, or one call
object) and the output is read back as tool_calls; "auto" still needs a format and says so.
A forced call cut short by max_tokens leaks no markup into content. Over the fake engine of
tests/unit/test_openai_tools.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from runtime.api.tools.grammar import json_calls_schema
from runtime.api.tools.parsers import JSON_CALLS, parse_tool_calls, tool_call_stream
from runtime.api.tools.request import parse_tool_request
from tests.unit.test_openai_tools import CITY, NAMED, TOOLS, USER, _events, _joined, _post
from tests.unit.test_openai_tools import front as front  # the fixture, re-exported

pytestmark = pytest.mark.timeout(60)

ARGS = '{"city": "Paris"}'
OBJECT = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def _no_format(front):
    serve, client, _, tokenizer = front
    tokenizer.chat_template = "{{ messages }}"  # shows no tool-call format
    return serve, client


def test_the_json_forced_is_the_arguments_or_one_call_object():
    named = parse_tool_request({"tools": TOOLS, "tool_choice": NAMED})
    assert json_calls_schema(named) == CITY
    required = json_calls_schema(parse_tool_request({"tools": TOOLS, "tool_choice": "required"}))
    assert required is not None
    jsonschema.validate(json.loads(OBJECT), required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "Rome"}}, required)
    auto = parse_tool_request({"tools": TOOLS, "tool_choice": "auto"})
    assert json_calls_schema(auto) is None


@pytest.mark.parametrize(
    "choice, text, finish",
    [(NAMED, ARGS, "stop"), ("required", OBJECT, "tool_calls")],
    ids=["named", "required"],
)
def test_forced_choices_need_no_tool_call_format(front, choice, text, finish):
    serve, client = _no_format(front)
    client.text = text
    with serve() as http:
        whole = _post(http, tools=TOOLS, tool_choice=choice)["choices"][0]
        streamed, streamed_finish = _joined(_events(http, tools=TOOLS, tool_choice=choice))
    tools = parse_tool_request({"tools": TOOLS, "tool_choice": choice})
    assert client.sent[0].params["structured_outputs"] == {"json": json_calls_schema(tools)}
    message = whole["message"]
    assert whole["finish_reason"] == finish == streamed_finish
    assert message["content"] is None and len(message["tool_calls"]) == 1
    call = message["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)
    assert streamed["content"] == ""
    assert [c["function"] for c in streamed["tool_calls"]] == [call["function"]]


def test_auto_without_a_format_says_what_would_do(front):
    serve, _ = _no_format(front)
    with serve() as http:
        resp = http.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": USER, "tools": TOOLS}
        )
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == "tools", resp.text
    assert "server.tool_parser" in error["message"] and '"required"' in error["message"]


@pytest.mark.parametrize(
    "choice, text",
    [
        ("required", '<tool_call>\n{"name": "get_wea'),
        ("required", "<tool_call>\n"),
        (NAMED, '<tool_call>\n{"name": "get_weather", "argu'),
    ],
)
def test_a_forced_call_cut_short_leaks_no_markup(front, choice, text):
    serve, client, _, _ = front  # the chat template's hermes format
    client.text, client.finish_reason = text, "length"
    with serve() as http:
        whole = _post(http, tools=TOOLS, tool_choice=choice, max_tokens=3)["choices"][0]
        streamed, finish = _joined(_events(http, tools=TOOLS, tool_choice=choice, max_tokens=3))
    assert whole["finish_reason"] == "length" == finish
    assert whole["message"]["content"] is None and "tool_calls" not in whole["message"]
    assert streamed["content"] == "" and streamed["tool_calls"] == []


def test_a_cut_short_call_keeps_its_valid_arguments():
    tools = parse_tool_request({"tools": TOOLS, "tool_choice": NAMED})
    content, calls = parse_tool_calls('{"city": "Pa', JSON_CALLS, tools=tools)
    assert content is None and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Pa',
    }
    stream = tool_call_stream(JSON_CALLS, tools)
    deltas = stream.feed(" {") + stream.feed('"city"') + stream.finish()
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city"'
