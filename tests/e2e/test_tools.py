"""Tool calling and structured outputs over HTTP (`tandem serve CONFIG --http`), driven by the
official `openai` client: a tiny random model whose tokenizer has a Hermes-style chat template
that takes tools (Qwen 2.5's, shortened: tests/chat_templates.py). The tools reach the chat
template (the prompt grows by their definitions), a tool result is taken back in the next
turn, a forced tool choice ("required", a named function) gives calls whose arguments
validate against the tool's parameters, streamed or not, and `chat.completions.parse` gives
a parsed object (the last two need the engine's grammar: structured_outputs). The random model
rarely calls a tool on its own: "auto" is checked for the shape of what it gives."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest

from tests import checkpoints, launch
from tests.chat_templates import QWEN_TEMPLATE, WEATHER, WEATHER_CALL_TURNS

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(240)

MODEL = "target"
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": ZONE}},
]
NOTE = {  # its lengths need llguidance (runtime.speculation.grammar.route): a Lark grammar
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 1, "maxLength": 12}},
    "required": ["text"],
    "additionalProperties": False,
}
GUIDED = [*TOOLS, {"type": "function", "function": {"name": "add_note", "parameters": NOTE}}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in GUIDED}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def oai(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("tools")
    target = checkpoints.build_with_tokenizer(root / MODEL, seed=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(target)
    draft = checkpoints.build_near_draft(target, root / "draft", noise=0.05)
    cfg = launch.write_config(root / "c.yaml", draft, target, max_seq_len=512)
    port, log_path = launch.free_port(), root / "serve.log"
    proc = launch.start_serve(
        cfg, f"ipc://{root}/server.sock", "--http", f"127.0.0.1:{port}", log_path=log_path
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        launch.wait_http(url, proc, log_path)
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        yield client
        client.close()
    finally:
        if proc.poll() is None:
            launch.stop(proc)
        launch.assert_group_gone(proc.pid)


def _chat(oai, **kwargs):
    args = {"model": MODEL, "messages": USER, "max_tokens": 8, "temperature": 0, **kwargs}
    return oai.chat.completions.create(**args)


def _check_calls(calls, names) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, its shape checked and its arguments validated."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def test_auto_renders_the_tools_and_answers(oai):
    plain = _chat(oai)
    out = _chat(oai, tools=TOOLS)
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools' definitions
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:  # a random model rarely calls, but may
        calls = choice.message.tool_calls
        assert all(call.function.name in PARAMETERS for call in calls)
    else:
        assert (
            choice.message.content
            == _chat(oai, tools=TOOLS, tool_choice="none").choices[0].message.content
        )


def test_a_tool_result_is_taken_back(oai):
    history = [*USER, *WEATHER_CALL_TURNS]
    first = _chat(oai, tools=TOOLS)
    out = _chat(oai, messages=history, tools=TOOLS)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result


def _streamed(oai, **kwargs):
    """(calls as (name, arguments JSON), finish reason) built from a stream's chunks."""
    calls: list[list[str]] = []
    finish = None
    for chunk in _chat(oai, stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index == len(calls) and call.type == "function"
                    calls.append([call.function.name, call.function.arguments or ""])
                else:
                    calls[call.index][1] += call.function.arguments
    return [tuple(c) for c in calls], finish


@pytest.mark.parametrize(
    "tools, choice, names, finish",
    [
        (TOOLS, NAMED, {"get_weather"}, "stop"),
        (TOOLS, "required", {"get_weather", "get_time"}, "tool_calls"),
        (GUIDED, "required", set(PARAMETERS), "tool_calls"),
    ],
    ids=["named", "required", "llguidance"],
)
def test_forced_calls_follow_the_tools_parameters(oai, tools, choice, names, finish):
    kwargs = dict(tools=tools, tool_choice=choice, parallel_tool_calls=False, max_tokens=60)
    out = _chat(oai, **kwargs).choices[0]
    assert out.finish_reason == finish, out
    assert out.message.content is None and len(out.message.tool_calls) == 1
    _check_calls(out.message.tool_calls, names)
    streamed, streamed_finish = _streamed(oai, **kwargs)
    whole = [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
    assert streamed == whole and streamed_finish == finish


def test_parse_gives_the_pydantic_object(oai):
    from pydantic import BaseModel

    class Forecast(BaseModel):
        city: Literal["Paris", "Oslo"]
        rain: bool

    out = oai.chat.completions.parse(
        model=MODEL, messages=USER, response_format=Forecast, max_tokens=40, temperature=0
    )
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and parsed.city in ("Paris", "Oslo")


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {
                "response_format": {"type": "json_object"},
                "extra_body": {"structured_outputs": {"regex": "a+"}},
            },
            "response_format",
        ),
    ],
)
def test_bad_tools_and_formats_are_400s_naming_them(oai, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(oai, **kwargs)
    error = info.value.body if "message" in info.value.body else info.value.body["error"]
    assert info.value.status_code == 400 and error["param"] == param, error
