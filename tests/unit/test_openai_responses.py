"""POST /v1/responses without a server: a Responses body as a chat completion's
(runtime.api.openai.responses_requests), its refusals as 400s naming the argument
(openai.validation, http.responses), and the reply, whole and as the SDK's event sequence
(openai.responses_events), over the fake engine of tests/unit/test_openai_tools.py, read by the
official SDK too. The served demo: tests/e2e/test_responses.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from runtime.api.http.app import create_app
from runtime.api.http.backend import AsyncWaiter
from runtime.api.openai.responses_requests import ResponsesRequest, to_chat
from runtime.control.protocol import Delta, Failed, Generate
from tests.unit.test_openai_tools import CALLS, CITY, ScriptClient
from tests.unit.test_openai_tools import front as front  # the fixture, re-exported

pytestmark = pytest.mark.timeout(60)

TOOL = {"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}
TEXT = "Hello there, my friend."
OPENING = ["response.created", "response.in_progress"]
MESSAGE = ["response.output_item.added", "response.content_part.added"]
MESSAGE_DONE = ["response.output_text.done", "response.content_part.done"]
ITEM_DONE = ["response.output_item.done"]


# --- the body as a chat completion's ------------------------------------------------------
def _chat(**body) -> dict:
    return to_chat(ResponsesRequest.model_validate({"model": "m", **body}))


def test_text_input_and_instructions_are_messages():
    chat = _chat(input="Hi", instructions="Be brief.", max_output_tokens=5, temperature=0)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert chat["max_tokens"] == 5 and chat["temperature"] == 0 and chat["stream"] is False


def test_an_agent_loops_items_are_a_chat_history():
    """What the SDK sends back: the last response's output (a message and its function
    calls, with their ids and status) and the calls' outputs."""
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user", "content": "Weather in Paris?"},
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call", "call_id": "c3", "name": "get_time", "arguments": "{}"},
    ]
    messages = _chat(input=items)["messages"]
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool", "assistant"]
    assert messages[2]["content"] == "Checking."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"}
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert messages[4]["content"] is None and messages[4]["tool_calls"][0]["id"] == "c3"


def test_tools_tool_choice_and_text_format_in_chats_shapes():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "A", "schema": schema, "strict": True}
    chat = _chat(
        input="x",
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": fmt},
    )
    function = {"name": "get_weather", "parameters": CITY, "strict": True}
    assert chat["tools"] == [{"type": "function", "function": function}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    spec = {"name": "A", "schema": schema, "strict": True}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": spec}
    assert _chat(input="x", tool_choice="required")["tool_choice"] == "required"
    assert _chat(input="x", text={"format": {"type": "text"}})["response_format"] == {
        "type": "text"
    }


# --- refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
        ({"conversation": "conv_1"}, "conversation", "stores no conversations"),
        ({"background": True}, "background", "background"),
        ({"foo": 1}, "foo", "Unrecognized request argument supplied: foo"),
        ({"input": None}, "input", "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input",
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "reasoning"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0].role"),
        ({"tools": [{"type": "web_search"}]}, "tools", "tools[0].type"),
        ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens: "),
        ({"temperature": 3}, "temperature", "[0, 2]"),
        ({"stream": "yes"}, "stream", "stream"),
        ({"text": {"format": {"type": "json_schema"}}}, "text", "text.format"),
        ({"model": "other"}, "model", "does not exist"),
    ],
)
def test_refusals_are_400s_naming_the_argument(front, body, param, words):
    serve, _, _, _ = front
    with serve() as http:
        resp = http.post("/v1/responses", json={"model": "tiny", "input": "x", **body})
    error = resp.json()["error"]
    assert resp.status_code in (400, 404) and error["param"] == param, resp.text
    assert words in error["message"], error["message"]


def test_a_body_that_is_no_json_object_is_a_400(front):
    serve, _, _, _ = front
    with serve() as http:
        for content in (b"{x", b"[1]"):
            resp = http.post(
                "/v1/responses", content=content, headers={"Content-Type": "application/json"}
            )
            assert resp.status_code == 400 and resp.json()["error"]["param"] is None, resp.text


# --- replies ----------------------------------------------------------------------------------
def _events(http, **body) -> list[dict]:
    body = {"model": "tiny", "input": "Hi", "stream": True, **body}
    resp = http.post("/v1/responses", json=body)
    assert resp.status_code == 200, resp.text
    events = []
    for block in resp.text.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _without_ids(response: dict) -> dict:
    output = [
        {k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]
    ]
    drop = ("id", "created_at", "output")
    return {**{k: v for k, v in response.items() if k not in drop}, "output": output}


def test_text_whole_and_as_the_sdks_event_sequence(front):
    serve, client, _, _ = front
    client.text = TEXT
    with serve() as http:
        whole = http.post("/v1/responses", json={"model": "tiny", "input": "Hi"}).json()
        events = _events(http)
    deltas = ["response.output_text.delta"] * 5  # the fake streams 5 characters a Delta
    expected = OPENING + MESSAGE + deltas + MESSAGE_DONE + ITEM_DONE + ["response.completed"]
    assert [e["type"] for e in events] == expected
    assert "".join(e["delta"] for e in events if "delta" in e) == TEXT
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    )
    last = events[-1]["response"]
    assert whole["status"] == "completed" and whole["object"] == "response"
    assert whole["output"][0]["content"][0]["text"] == TEXT
    assert whole["usage"] == {
        "input_tokens": 3,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 8,
    }
    assert _without_ids(last) == _without_ids(whole)
    item_ids = {e["item_id"] for e in events if "item_id" in e}
    assert item_ids == {last["output"][0]["id"]}


def test_tool_calls_are_function_call_items(front):
    serve, client, _, _ = front
    client.text = CALLS  # "Sure." then two calls, in the chat template's hermes format
    tools = [TOOL, {"type": "function", "name": "get_time"}]
    with serve() as http:
        whole = http.post("/v1/responses", json={"model": "tiny", "input": "Hi", "tools": tools})
        events = _events(http, tools=tools)
    output = whole.json()["output"]
    assert [item["type"] for item in output] == ["message", "function_call", "function_call"]
    assert output[0]["content"][0]["text"] == "Sure."
    assert [(c["name"], json.loads(c["arguments"])) for c in output[1:]] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert all(c["call_id"].startswith("call_") and c["id"].startswith("fc_") for c in output[1:])
    kinds = [e["type"] for e in events]
    call = ["response.output_item.added", "response.function_call_arguments.delta"]
    assert kinds[: len(OPENING + MESSAGE)] == OPENING + MESSAGE
    assert (
        kinds.count("response.output_item.added") == 3 == kinds.count("response.output_item.done")
    )
    assert kinds[kinds.index(call[0], 3) + 1] == call[1]
    assert kinds.count("response.function_call_arguments.done") == 2
    assert _without_ids(events[-1]["response"]) == _without_ids(whole.json())


def test_cut_short_is_incomplete(front):
    serve, client, _, _ = front
    client.text, client.finish_reason = TEXT, "length"
    with serve() as http:
        whole = http.post("/v1/responses", json={"model": "tiny", "input": "Hi"}).json()
        events = _events(http)
    for response in (whole, events[-1]["response"]):
        assert response["status"] == "incomplete", response
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        assert response["output"][0]["status"] == "incomplete"
    assert events[-1]["type"] == "response.completed"


class FailingClient(ScriptClient):
    """Streams one piece of text, then fails the request (a dead engine)."""

    def open_async(self, msg: Generate):
        self.sent.append(msg)
        waiter = AsyncWaiter(asyncio.get_running_loop())
        waiter.queue.put_nowait(Delta(msg.id, 0, [10], "Hel"))
        waiter.queue.put_nowait(Failed(msg.id, "rank 1 exited", "dead"))
        return waiter


def test_a_failure_midway_is_response_failed():
    with TestClient(create_app(FailingClient(""), "tiny")) as http:
        events = _events(http)
    assert [e["type"] for e in events][-4:] == [*MESSAGE_DONE, *ITEM_DONE, "response.failed"]
    response = events[-1]["response"]
    assert response["status"] == "failed" and response["error"]["code"] == "server_error"
    assert "rank 1 exited" in response["error"]["message"]


def test_the_sdk_reads_the_reply_and_its_stream(front):
    openai = pytest.importorskip("openai")
    serve, client, _, tokenizer = front
    tokenizer.chat_template = "{{ messages }}"  # no tool-call format: a forced call's JSON
    client.text = '{"city": "Oslo"}'
    named = {"type": "function", "name": "get_weather"}
    with serve() as http:
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        out = oai.responses.create(model="tiny", input="Hi", tools=[TOOL], tool_choice=named)
        with oai.responses.stream(
            model="tiny", input="Hi", tools=[TOOL], tool_choice=named
        ) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
    assert client.sent[0].params["structured_outputs"] == {"json": CITY}
    for response in (out, final):
        call = response.output[0]
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Oslo"} and response.output_text == ""
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    assert final.output[0].parsed_arguments == {"city": "Oslo"}  # the SDK's, of a strict tool
