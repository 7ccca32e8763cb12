"""Tool calling's pure pieces (runtime/api/tools/*.py): generated text read as OpenAI tool
calls in the hermes and llama3_json formats, whole and streamed (the deltas of every split of
an output add up to the whole result), the request's tools and tool_choice checked, the
grammar of a forced choice (a JSON schema checked with jsonschema, a structural tag compiled
by xgrammar), and a conversation with tool calls through a real Hermes-style chat template."""

from __future__ import annotations

import copy
import itertools
import json
import random
import re

import pytest

from runtime.api.openai.requests import value_error
from runtime.api.tools.grammar import call_schema, tool_grammar
from runtime.api.tools.json_prefix import JsonPrefix
from runtime.api.tools.parsers import (
    ToolCallStream,
    detect_tool_parser,
    new_call_id,
    parse_tool_calls,
    tool_finish_reason,
    tool_parser_name,
)
from runtime.api.tools.request import ToolRequest, parse_tool_request
from runtime.serving.chat import chat_messages_with_tools, render_chat
from tests.chat_templates import QWEN_TEMPLATE, WEATHER_CALL_TURNS

pytestmark = pytest.mark.timeout(30)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {}}'
NESTED_ARGS = '{"q": "a \\"quoted\\" \\\\ \\u00e9 ✓", "xs": [1, -2.5e-3, {"x": null}, true]}'
HERMES = [
    "Just text, no calls.",
    "",
    "   \n",
    f"Let me look that up.\n<tool_call>\n{WEATHER}\n</tool_call>",
    f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n",
    f"<tool_call>{WEATHER}</tool_call>\nand then\n<tool_call>{TIME}</tool_call> done",
    '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',
    f'<tool_call>\n{{"name": "search", "arguments": {NESTED_ARGS}}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather" "arguments": {}}\n</tool_call> oops',
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"a": [1, 2',
    '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call> after',
    f"<tool_call>{WEATHER}\n<tool_call>{TIME}",
    "a < b <tool_cal x <tool_call",
    '<tool_call>\n{"name": "get_time"}\n</tool_call>',
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
]
LLAMA = [
    "Paris is sunny.",
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '{"name": "get_weather", "parameters": {"city": "Paris"}};'
    ' {"name": "get_time", "parameters": {}}',
    '  {"name": "get_time", "arguments": {}}\n',
    '{"answer": 42} is JSON, not a call',
    '{"name": "f", "parameters": {"x": 1e',
    'I think {"name": "f", "parameters": {}}',
    '{"name": "f", "parameters": {}}; then text',
    "<|python_tag|>brave_search.call(query='x')",
]


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter):024d}"


# --- parsing ------------------------------------------------------------------------------
def test_hermes_calls_and_the_content_before_them():
    content, calls = parse_tool_calls(HERMES[3], "hermes")
    assert content == "Let me look that up."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert calls[0]["type"] == "function" and re.fullmatch(r"call_[A-Za-z0-9]{24}", calls[0]["id"])
    content, calls = parse_tool_calls(HERMES[4], "hermes")
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert calls[1]["function"]["arguments"] == "{}" and calls[0]["id"] != calls[1]["id"]
    content, calls = parse_tool_calls(HERMES[5], "hermes")
    assert content == "\nand then done" and len(calls) == 2


def test_hermes_other_key_orders_escapes_and_missing_arguments():
    (_, calls) = parse_tool_calls(HERMES[6], "hermes")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    (_, calls) = parse_tool_calls(HERMES[7], "hermes")
    assert json.loads(calls[0]["function"]["arguments"]) == json.loads(NESTED_ARGS)
    (_, calls) = parse_tool_calls(HERMES[14], "hermes")
    assert calls[0]["function"] == {"name": "get_time", "arguments": "{}"}


@pytest.mark.parametrize("index", [0, 1, 2, 8, 9, 13, 15])
def test_text_that_is_no_call_is_content_as_written(index):
    assert parse_tool_calls(HERMES[index], "hermes") == (HERMES[index], [])


def test_a_call_cut_short_keeps_its_valid_json():
    assert parse_tool_calls(HERMES[10], "hermes")[1][0]["function"]["arguments"] == '{"a": [1, 2'
    content, calls = parse_tool_calls(HERMES[11], "hermes")
    assert calls[0]["function"]["arguments"] == '{"a": tru' and content == " after"
    content, calls = parse_tool_calls(HERMES[12], "hermes")  # no </tool_call>: still two calls
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]


def test_llama3_json_calls():
    assert parse_tool_calls(LLAMA[0], "llama3_json") == (LLAMA[0], [])
    content, calls = parse_tool_calls(LLAMA[1], "llama3_json")
    assert content is None and calls[0]["function"]["arguments"] == '{"city": "Paris"}'
    content, calls = parse_tool_calls(LLAMA[2], "llama3_json")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert parse_tool_calls(LLAMA[3], "llama3_json")[1][0]["function"]["name"] == "get_time"
    for text in (LLAMA[4], LLAMA[6], LLAMA[8]):
        assert parse_tool_calls(text, "llama3_json") == (text, [])
    content, calls = parse_tool_calls(LLAMA[7], "llama3_json")
    assert content == "; then text" and len(calls) == 1


def test_json_prefix_checker():
    def valid_prefix(text):
        checker = JsonPrefix()
        return all(checker.feed(c) for c in text), checker.done

    assert valid_prefix('{"a": [1, -0.5e+3, "x\\u00e9", true, null, {}]}') == (True, True)
    assert valid_prefix('{"a": [1, 2') == (True, False)
    for bad in ('{"a" 1}', "{'a': 1}", '{"a": 01}', '{"a": tru}', '{"a": "\\q"}', "[1,]", "{}}"):
        assert valid_prefix(bad)[0] is False, bad


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind < 5:
        return [None, True, rng.randint(-99, 99), rng.random() * 1e5, 'a"\\\u00e9\n'][kind]
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {f"k{i}": _random_json(rng, depth + 1) for i in range(rng.randrange(3))}


def test_the_json_checker_agrees_with_json_loads():
    """Whole JSON texts, and texts one character away from them."""
    rng = random.Random(1)
    for _ in range(1500):
        value = [_random_json(rng, 1)] if rng.random() < 0.5 else {"k": _random_json(rng, 1)}
        text = json.dumps(value, indent=rng.choice([None, 1]))
        if rng.random() < 0.8:
            at = rng.randrange(len(text) + 1)
            text = text[:at] + rng.choice('{}[]",:.-+eE0\\ tu') + text[at + rng.randrange(2) :]
        checker = JsonPrefix()
        fed = all(checker.feed(c) for c in text)
        try:
            expected = isinstance(json.loads(text), (dict, list))
        except ValueError:
            expected = False
        assert (fed and checker.done) == expected, text


def test_the_parser_is_named_or_found_in_the_template():
    assert detect_tool_parser("{{- '<tool_call>\\n' }}") == "hermes"
    assert detect_tool_parser("{%- if message.role == 'ipython' %}") == "llama3_json"
    assert detect_tool_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_tool_parser({"default": "x", "tool_use": "<tool_call>"}) == "hermes"
    assert detect_tool_parser("{{ messages }}") is None and detect_tool_parser(None) is None
    assert tool_parser_name("llama3_json", "<tool_call>") == "llama3_json"
    assert tool_parser_name(None, "<tool_call>") == "hermes"
    with pytest.raises(ValueError, match="^tool_parser: "):
        tool_parser_name("mistral")
    with pytest.raises(ValueError, match="^tools: "):
        tool_parser_name(None, "{{ messages }}")


def test_ids_and_finish_reason():
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    assert tool_finish_reason("stop", True) == "tool_calls"
    assert tool_finish_reason("length", True) == "length"
    assert tool_finish_reason("stop", False) == "stop"


# --- streaming ----------------------------------------------------------------------------
def _splits(text: str, rng: random.Random):
    """Every chunk size from 1 to all at once, every cut in two, and random splits."""
    n = len(text)
    for size in range(1, n + 1):
        yield [text[i : i + size] for i in range(0, n, size)]
    for cut in range(1, n):
        yield [text[:cut], text[cut:]]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(1, 8)))) if n > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, n])]


def _stream(parser: str, chunks: list[str]):
    stream, deltas, so_far = ToolCallStream(parser, _ids()), [], ""
    for chunk in chunks:
        so_far += chunk
        deltas += stream.update(so_far)
    deltas += stream.finish()
    return deltas, stream.result()


def _joined(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """What a client builds from the deltas (checking each delta's shape)."""
    content, calls = "", []
    for delta in deltas:
        assert len(delta) == 1, delta
        if "content" in delta:
            assert delta["content"]
            content += delta["content"]
            continue
        (call,) = delta["tool_calls"]
        if "id" in call:  # a call's first delta: its index, id, type and name
            assert call["index"] == len(calls) and call["type"] == "function"
            assert call["function"]["arguments"] == "" and call["function"]["name"]
            calls.append({"id": call["id"], "type": "function", "function": call["function"]})
        else:
            assert call["index"] == len(calls) - 1 and set(call) == {"index", "function"}
            assert call["function"]["arguments"]
            calls[-1]["function"]["arguments"] += call["function"]["arguments"]
    return (None if not content and calls else content), calls


@pytest.mark.parametrize("parser, texts", [("hermes", HERMES), ("llama3_json", LLAMA)])
def test_every_split_streams_the_whole_result(parser, texts):
    rng = random.Random(0)
    for text in texts:
        whole = parse_tool_calls(text, parser, _ids())
        if not whole[1]:
            assert whole == (text, [])
        for chunks in _splits(text, rng):
            deltas, result = _stream(parser, chunks)
            assert _joined(deltas) == whole == result, (text, chunks)


FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_", "\n", " ", "Hi", WEATHER, TIME, "{", "}"],
    "llama3_json": ["<|python_tag|>", "<|py", "; ", "\n", " ", "Hi", WEATHER, "{", "}", '"'],
}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_random_outputs_stream_their_whole_result(parser):
    rng = random.Random(2)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS[parser]) for _ in range(rng.randrange(1, 9)))
        whole = parse_tool_calls(text, parser, _ids())
        for chunks in itertools.islice(_splits(text, rng), 0, None, 7):
            deltas, result = _stream(parser, chunks)
            assert _joined(deltas) == whole == result, (text, chunks)


def test_the_stream_holds_back_only_what_may_be_a_call():
    stream = ToolCallStream("hermes", _ids())
    assert stream.update("Sure. <tool_") == [{"content": "Sure."}]
    assert stream.update("Sure. <tool_call>\n") == []
    assert stream.update('Sure. <tool_call>\n{"name": "get_time", "argu') == []
    first = stream.update('Sure. <tool_call>\n{"name": "get_time", "arguments": {"tz": ')
    call = {"index": 0, "id": "call_" + "0" * 24, "type": "function"}
    call["function"] = {"name": "get_time", "arguments": ""}
    args = {"index": 0, "function": {"arguments": '{"tz": '}}
    assert first == [{"tool_calls": [call]}, {"tool_calls": [args]}]
    assert stream.feed('"UTC"}}\n</tool_call>') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '"UTC"}'}}]}
    ]
    assert stream.finish() == [] and stream.has_calls
    plain = ToolCallStream("hermes")
    assert plain.update("x <tool") == [{"content": "x"}] and plain.finish() == [
        {"content": " <tool"}
    ]


# --- requests -----------------------------------------------------------------------------
def _tool(name: str, parameters: dict | None = None, **extra) -> dict:
    function = {"name": name, **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [_tool("get_weather", CITY, description="The weather"), _tool("get_time")]


def test_tool_requests_and_their_defaults():
    assert parse_tool_request({}).choice == "none" and not parse_tool_request({}).parses
    req = parse_tool_request({"tools": TOOLS})
    assert req.choice == "auto" and req.parses and not req.forced and req.parallel
    assert req.template_tools() == TOOLS and req.parameters("get_time")["properties"] == {}
    req = parse_tool_request({"tools": TOOLS, "tool_choice": "none"})
    assert not req.parses and req.template_tools() == TOOLS
    named = {"type": "function", "function": {"name": "get_time"}}
    req = parse_tool_request({"tools": TOOLS, "tool_choice": named, "parallel_tool_calls": False})
    assert (req.choice, req.function, req.forced) == ("function", "get_time", True)
    assert not req.parallel


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"tools": {"a": 1}}, "tools", "list"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools", "tools[0]"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools", "tools[0].function.name"),
        ({"tools": [_tool("bad name")]}, "tools", "tools[0].function.name"),
        ({"tools": [_tool("f"), _tool("f")]}, "tools", "given twice"),
        ({"tools": [_tool("f", [1])]}, "tools", "tools[0].function.parameters"),
        ({"tools": [_tool("f", {"type": "array"})]}, "tools", "type object"),
        ({"tools": [_tool("f", description=3)]}, "tools", "description"),
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "'any'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "function"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope' is not among the tools",
        ),
        ({"tools": TOOLS, "tool_choice": 3}, "tool_choice", '"required" or'),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ],
)
def test_bad_tool_arguments_are_400s_naming_them(body, param, words):
    with pytest.raises(ValueError) as caught:
        parse_tool_request(body)
    assert str(caught.value).startswith(param) and words in str(caught.value)
    error = value_error(caught.value, "max_tokens", "messages")  # as the front answers it
    assert error.status == 400 and error.param == param


# --- forced choices: the schema and the grammar --------------------------------------------
HERMES_FORCED = {
    "one": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "two": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "text first": 'Sure.<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "bad args": '<tool_call>\n{"name": "get_weather", "arguments": {"town": "x"}}\n</tool_call>',
    "unknown": '<tool_call>\n{"name": "get_moon", "arguments": {}}\n</tool_call>',
}
LLAMA_FORCED = {
    "one": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "two": '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {}}',
    "text first": 'Sure.{"name": "get_time", "parameters": {}}',
    "bad args": '{"name": "get_weather", "parameters": {"city": 3}}',
    "unknown": '{"name": "get_moon", "parameters": {}}',
}
WEATHER_CHOICE = {"type": "function", "function": {"name": "get_weather"}}
SAMPLES = [("hermes", HERMES_FORCED), ("llama3_json", LLAMA_FORCED)]


def _req(**body) -> ToolRequest:
    return parse_tool_request({"tools": TOOLS, **body})


def test_auto_and_none_force_nothing():
    for choice in ("auto", "none"):
        assert tool_grammar(_req(tool_choice=choice), "hermes") is None


@pytest.mark.parametrize("parser, samples", SAMPLES)
def test_the_call_schema_accepts_the_forced_calls_only(parser, samples):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema: the test extra's")
    named, required = _req(tool_choice=WEATHER_CHOICE), _req(tool_choice="required")
    key = "arguments" if parser == "hermes" else "parameters"

    def accepted(req, sample):
        calls = parse_tool_calls(samples[sample], parser)[1]
        objs = [
            {"name": c["function"]["name"], key: json.loads(c["function"]["arguments"])}
            for c in calls
        ]
        validator = jsonschema.Draft202012Validator(call_schema(req, parser))
        return all(validator.is_valid(obj) for obj in objs)

    assert accepted(named, "one") and not accepted(named, "two")
    assert accepted(required, "one") and accepted(required, "two")
    for req in (named, required):
        assert not accepted(req, "bad args") and not accepted(req, "unknown")
    assert jsonschema.Draft202012Validator.check_schema(call_schema(required, parser)) is None


@pytest.mark.parametrize("parser, samples", SAMPLES)
def test_the_structural_tag_compiles_and_forces_the_calls(parser, samples):
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    def accepts(body: dict) -> set[str]:
        grammar = tool_grammar(_req(**body), parser)
        assert grammar is not None
        compiled = xgrammar.Grammar.from_structural_tag(grammar.structural_tag)
        return {name for name, text in samples.items() if _is_grammar_accept_string(compiled, text)}

    assert accepts({"tool_choice": WEATHER_CHOICE}) == {"one"}
    assert accepts({"tool_choice": "required"}) == {"one", "two"}
    assert accepts({"tool_choice": "required", "parallel_tool_calls": False}) == {"one"}
    # a named function is spelled as xgrammar's own builtin tags spell it
    builtin = {"hermes": "qwen_3", "llama3_json": "llama"}[parser]
    theirs = xgrammar.get_model_structural_tag(
        builtin, tools=TOOLS, tool_choice=WEATHER_CHOICE, reasoning="disabled"
    )
    grammar = tool_grammar(_req(tool_choice=WEATHER_CHOICE), parser)
    assert grammar is not None
    assert (
        xgrammar.StructuralTag.from_json(grammar.structural_tag).model_dump() == theirs.model_dump()
    )
    assert '"get_weather' in grammar.ebnf()


# --- history messages and the chat template -----------------------------------------------
CONVERSATION = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    *WEATHER_CALL_TURNS,
]


def test_history_messages_as_templates_take_them():
    messages = chat_messages_with_tools(CONVERSATION)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1] == {"role": "user", "content": "Weather in Paris?"}
    assert messages[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert messages[3] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}
    odd = {"name": "f", "arguments": "not json"}  # kept as given
    call = chat_messages_with_tools([{"role": "assistant", "tool_calls": [{"function": odd}]}])
    assert call[0]["tool_calls"][0]["function"]["arguments"] == "not json"


@pytest.mark.parametrize(
    "message, words",
    [
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
        ({"role": "assistant", "tool_calls": {"a": 1}}, "messages[0].tool_calls"),
        (
            {"role": "assistant", "tool_calls": [{"function": {}}]},
            "messages[0].tool_calls[0].function",
        ),
        ({"role": "user", "content": [{"type": "image_url"}]}, "messages[0].content"),
        ({"content": "x"}, "messages[0]"),
    ],
)
def test_bad_history_messages_name_them(message, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        chat_messages_with_tools([message])


@pytest.fixture(scope="module")
def hermes_tokenizer():
    from tests.checkpoints import smollm2_tokenizer

    tokenizer = copy.deepcopy(smollm2_tokenizer())  # the shared one stays as it is
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


def test_a_conversation_with_tools_through_a_hermes_template(hermes_tokenizer):
    assert detect_tool_parser(hermes_tokenizer.chat_template) == "hermes"
    req = parse_tool_request({"tools": TOOLS})
    messages = chat_messages_with_tools(CONVERSATION)
    text = render_chat(hermes_tokenizer, messages, req.template_tools(), tokenize=False)
    assert isinstance(text, str)
    for tool in TOOLS:  # the definitions
        assert json.dumps(tool, ensure_ascii=False) in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert call in text and '<tool_response>\n{"temp": 21}\n</tool_response>' in text
    assert text.startswith("<|im_start|>system\nBe brief.") and text.endswith(
        "<|im_start|>assistant\n"
    )
    # the call the template shows reads back as the call it came from
    (_, calls) = parse_tool_calls(call, "hermes")
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    ids = render_chat(hermes_tokenizer, messages, req.template_tools())
    assert isinstance(ids, list) and hermes_tokenizer.decode(ids) == text
    with pytest.raises(ValueError, match="^messages: the chat template failed"):
        render_chat(hermes_tokenizer, [{"role": "user"}], None)
