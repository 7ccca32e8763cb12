"""The Responses API and forced tool choices against `tandem serve --http` of the built-in
demo (SmolLM2-135M-Instruct, whose chat template shows no tool-call format), driven by the
official `openai` client, greedy: `responses.create` and `responses.stream` give the text of
the same request's chat completion (plain, and under a json_schema `text.format`), a function
named in tool_choice is a function_call item; on chat completions a named and a "required"
tool_choice give tool_calls whose arguments validate against the tool's parameters (the
grammar forces the call's JSON: no tool-call parser needed), and a forced call cut short
leaks nothing into content. The rules themselves: tests/unit/test_openai_responses.py,
test_openai_tool_choice.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import jsonschema
import pytest

from runtime.config import default_config
from tests import launch
from tests.chat_templates import WEATHER
from tests.fuzz_http import fuzz

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(300)

CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER},
}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}
ASK = "What is the weather in Paris?"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """(client, model id) of the demo served over HTTP."""
    try:
        default_config()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("responses")
    port, log_path = launch.free_port(), root / "serve.log"
    command = ["-m", "launcher", "serve", "--address", f"ipc://{root}/s.sock"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, *command, "--http", f"127.0.0.1:{port}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(launch.clean_env(), TANDEM_LAUNCH="spawn"),
        )
    try:
        launch.wait_http(f"http://127.0.0.1:{port}", proc, log_path)
        url = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=240)
        yield client, client.models.list().data[0].id
        client.close()
        assert launch.stop(proc) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    launch.assert_group_gone(proc.pid)


def test_the_demo_serves_as_the_docs_show(demo):
    """docs/serving.md's example against `tandem serve --http` of the built-in demo: the
    served model is the one /v1/models lists (the target's file name)."""
    oai, model = demo
    assert model == os.path.basename(default_config().target.model)
    out = oai.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    assert out.model == model and out.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as info:  # OpenAI's range is [0, 2]
        oai.completions.create(model=model, prompt="a", max_tokens=2, temperature=2.5)
    body = info.value.body
    assert (body if "param" in body else body["error"])["param"] == "temperature", body


def test_fuzzed_bodies_from_the_openapi_schema(demo):
    """Schemathesis against the served demo (tests/fuzz_http.py): no 5xx, no answer the
    schema does not document, no hang; then the demo still serves."""
    pytest.importorskip("schemathesis")
    oai, model = demo
    statuses = fuzz(str(oai.base_url).rstrip("/").removesuffix("/v1"), model)
    assert statuses[200] and statuses[400], statuses  # some served, some refused
    assert set(statuses) <= {200, 400, 404}, statuses
    out = oai.completions.create(model=model, prompt="Still", max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason == "length"


def _chat(demo, **kwargs):
    oai, model = demo
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}]
    return oai.chat.completions.create(model=model, messages=messages, **GREEDY, **kwargs)


def _respond(demo, **kwargs):
    oai, model = demo
    return oai.responses.create(
        model=model, instructions="Answer briefly.", input=ASK, **GREEDY, **kwargs
    )


def test_text_and_its_stream_equal_the_chat_completion(demo):
    oai, model = demo
    chat = _chat(demo, max_tokens=8).choices[0]
    out = _respond(demo, max_output_tokens=8)
    assert out.output_text == chat.message.content and out.output_text
    assert out.status == ("incomplete" if chat.finish_reason == "length" else "completed")
    assert out.usage.output_tokens == 8 or chat.finish_reason == "stop"
    deltas = []
    with oai.responses.stream(
        model=model, instructions="Answer briefly.", input=ASK, max_output_tokens=8, **GREEDY
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == out.output_text


def test_a_json_schema_text_format_is_the_chats_structured_output(demo):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    out = _respond(demo, max_output_tokens=40, text={"format": fmt})
    jsonschema.validate(json.loads(out.output_text), WEATHER)
    spec = {"name": "weather", "schema": WEATHER, "strict": True}
    chat = _chat(demo, max_tokens=40, response_format={"type": "json_schema", "json_schema": spec})
    assert out.output_text == chat.choices[0].message.content


def test_a_named_function_is_a_function_call_item(demo):
    named = {"type": "function", "name": "get_weather"}
    out = _respond(demo, max_output_tokens=40, tools=[TOOL], tool_choice=named)
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    chat_choice = {"type": "function", "function": {"name": "get_weather"}}
    chat = _chat(demo, max_tokens=40, tools=[CHAT_TOOL], tool_choice=chat_choice)
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    # an agent loop's next turn: the output sent back, with the tool's result
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}
    oai, model = demo
    history = [{"role": "user", "content": ASK}, *out.output, result]
    after = oai.responses.create(model=model, input=history, max_output_tokens=4, **GREEDY)
    function = {"name": call.name, "arguments": call.arguments}
    chat_call = {"id": call.call_id, "type": "function", "function": function}
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"},
    ]
    chat_after = oai.chat.completions.create(model=model, messages=messages, max_tokens=4, **GREEDY)
    assert after.usage.input_tokens == chat_after.usage.prompt_tokens  # the same conversation
    assert after.output_text == chat_after.choices[0].message.content


@pytest.mark.parametrize(
    "choice, finish",
    [
        ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
        ("required", "tool_calls"),
    ],
    ids=["named", "required"],
)
def test_forced_tool_choices_need_no_parser(demo, choice, finish):
    time_tool = {"type": "function", "function": {"name": "get_time", "parameters": WEATHER}}
    out = _chat(demo, max_tokens=60, tools=[CHAT_TOOL, time_tool], tool_choice=choice).choices[0]
    assert out.finish_reason == finish and out.message.content is None, out
    (call,) = out.message.tool_calls
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_a_forced_call_cut_short_leaks_nothing(demo):
    out = _chat(demo, max_tokens=3, tools=[CHAT_TOOL], tool_choice="required").choices[0]
    assert out.finish_reason == "length" and out.message.content is None, out
