"""Forced tool calls whose parameters need llguidance (runtime.api.tools.grammar's Lark,
a "lark" GrammarSpec): the calls spelled as the xgrammar structural tag spells them, random
walks under the masks giving calls whose arguments validate, one call when parallel calls are
off, stop tokens only once a call is complete, refusals naming the tool, and the kind kept
internal. Plain tools keep xgrammar's EBNF. No processes: the compile child's answer and the
workers' loader run here. SmolLM2's tokenizer (49,152 tokens)."""

from __future__ import annotations

import json
import random

import jsonschema
import llguidance
import pytest

from runtime.api.tools.grammar import CALL_FORMATS, _lark, tool_grammar
from runtime.api.tools.parsers import parse_tool_calls
from runtime.api.tools.request import parse_tool_request
from runtime.speculation.grammar import child, guidance
from runtime.speculation.grammar.load import GrammarLoader, Prepared, job_of, tokenizer_info
from runtime.speculation.grammar.route import GUIDANCE_JSON_OPTIONS, uses_guidance
from runtime.speculation.grammar.spec import (
    MAX_REPEAT,
    MAX_SPEC_CHARS,
    GrammarSpec,
    parse_structured_outputs,
)
from runtime.speculation.grammar.window import GrammarWindow
from tests.checkpoints import smollm2_tokenizer
from tests.grammar_walks import walk


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


CITY = {  # xgrammar's counted string would let raw control characters in
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 6}},
    "required": ["city"],
    "additionalProperties": False,
}
RANGE = {  # xgrammar ignores an allOf of several subschemas and multipleOf on a number
    "type": "object",
    "properties": {"lo": {"type": "integer"}, "step": {"type": "number"}},
    "allOf": [
        {"properties": {"lo": {"minimum": 0, "maximum": 99}}, "required": ["lo"]},
        {"properties": {"step": {"multipleOf": 0.5, "maximum": 9}}},
    ],
    "required": ["step"],
    "additionalProperties": False,
}
ZONE = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
GUIDED = [_tool("get_weather", CITY), _tool("set_range", RANGE), _tool("get_zone", ZONE)]
PLAIN = [_tool("get_zone", ZONE), _tool("get_time", {"type": "object", "properties": {}})]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in GUIDED + PLAIN}
PARSERS = ("hermes", "llama3_json")
RANGE_CHOICE = {"type": "function", "function": {"name": "set_range"}}


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def closers(tok) -> frozenset[int]:
    """The tokens that close something: a quote, a brace, a bracket."""
    return frozenset(i for i in range(len(tok)) if any(c in tok.decode([i]) for c in '"}]'))


@pytest.fixture(scope="module")
def info(tok):
    return tokenizer_info(tok, len(tok))


def _grammar(tools: list[dict], parser: str, **body):
    grammar = tool_grammar(parse_tool_request({"tools": tools, **body}), parser)
    assert grammar is not None
    return grammar


# --- routing: which backend a forced call uses ----------------------------------------------


@pytest.mark.parametrize("parser", PARSERS)
def test_plain_tools_keep_xgrammars_ebnf(parser):
    for body in ({"tool_choice": "required"}, {"tool_choice": {**RANGE_CHOICE}}):
        tools = PLAIN if body["tool_choice"] == "required" else [*PLAIN, _tool("set_range", ZONE)]
        grammar = _grammar(tools, parser, **body)
        spec = grammar.spec()
        assert grammar.lark is None and spec == GrammarSpec("grammar", grammar.ebnf())
        assert not uses_guidance(spec)


@pytest.mark.parametrize("parser", PARSERS)
def test_a_guided_tool_makes_the_forced_call_lark(parser):
    fmt = CALL_FORMATS[parser]
    grammar = _grammar(GUIDED, parser, tool_choice="required")
    spec = grammar.spec()
    assert spec.kind == "lark" and spec.text == grammar.lark and spec.argument == "tools"
    assert uses_guidance(spec) and job_of(spec) == ["lark", spec.text]
    lines = spec.text.splitlines()
    assert lines[:2] == [
        f"start: call ({json.dumps(fmt.separator)} call)*",
        "call: " + " | ".join(f"call_{i}" for i in range(3)),
    ]
    assert lines[2] == f"call_0: {json.dumps(fmt.tag_begin('get_weather'))} args_0 " + json.dumps(
        fmt.end
    )
    schema = json.loads(lines[3].removeprefix("args_0: %json "))
    assert schema == {**CITY, "x-guidance": GUIDANCE_JSON_OPTIONS}
    named = _grammar(GUIDED, parser, tool_choice=RANGE_CHOICE).spec().text.splitlines()
    assert named[:2] == ["start: call", "call: call_0"] and "set_range" in named[2]
    one = _grammar(GUIDED, parser, tool_choice="required", parallel_tool_calls=False)
    assert one.spec().text.startswith("start: call\ncall: call_0 | call_1 | call_2\n")


def test_lark_is_a_structured_output_and_bounded():
    assert parse_structured_outputs({"lark": 'start: "a"'}) == GrammarSpec("lark", 'start: "a"')
    with pytest.raises(ValueError, match="^structured_outputs: lark must be a non-empty string"):
        parse_structured_outputs({"lark": " "})
    with pytest.raises(ValueError, match="over the limit"):
        GrammarSpec("lark", "x" * (MAX_SPEC_CHARS + 1), "tools")
    with pytest.raises(ValueError, match="^tools: the repetition"):
        GrammarSpec("lark", f"start: /a{{{MAX_REPEAT + 1}}}/", "tools")
    big = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1}}}
    big["description"] = "x" * MAX_SPEC_CHARS
    with pytest.raises(ValueError, match="^tools: the lark is"):
        _grammar([_tool("f", big)], "hermes", tool_choice="required").spec()


@pytest.mark.parametrize("parser", PARSERS)
def test_llguidance_refusals_name_the_tool(parser, info):
    bad = {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}}
    grammar = _grammar([*GUIDED, _tool("nope", bad)], parser, tool_choice="required")
    with pytest.raises(ValueError, match=r"^tools: the parameters of 'nope' cannot be enforced: "):
        grammar.spec()
    with pytest.raises(ValueError, match=r"Unimplemented keys: \[\"not\"\]"):
        grammar.spec()
    settings = {"tokenizer_info": info, "probe_steps": 4, "probe_mask_s": 1.0}
    answer = child._answer(None, settings, json.dumps(["lark", grammar.lark]).encode())
    assert answer.startswith(child.FAILED) and b"Unimplemented keys" in answer


# --- the format: the same calls as the structural tag ---------------------------------------

HERMES = {
    "one": '<tool_call>\n{"name": "get_zone", "arguments": {"tz": "UTC"}}\n</tool_call>',
    "two": '<tool_call>\n{"name": "get_zone", "arguments": {"tz": "UTC"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "trailing": '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
    "spaced": '<tool_call>\n{"name": "get_zone", "arguments": {"tz" : "UTC"}}\n</tool_call>',
    "text first": 'Sure.<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "bad args": '<tool_call>\n{"name": "get_zone", "arguments": {"tz": "X"}}\n</tool_call>',
    "unknown": '<tool_call>\n{"name": "get_moon", "arguments": {}}\n</tool_call>',
}
LLAMA = {
    "one": '{"name": "get_zone", "parameters": {"tz": "UTC"}}',
    "two": '{"name": "get_zone", "parameters": {"tz": "UTC"}}; '
    '{"name": "get_time", "parameters": {}}',
    "trailing": '{"name": "get_time", "parameters": {}}; ',
    "spaced": '{"name": "get_zone", "parameters": {"tz":"UTC"}}',
    "text first": 'Sure.{"name": "get_time", "parameters": {}}',
    "bad args": '{"name": "get_zone", "parameters": {"tz": 3}}',
    "unknown": '{"name": "get_moon", "parameters": {}}',
}


@pytest.mark.parametrize("parser, samples", [("hermes", HERMES), ("llama3_json", LLAMA)])
def test_the_lark_accepts_what_the_structural_tag_accepts(parser, samples, info):
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    llt = guidance.guidance_tokenizer(info)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in PLAIN}
    for body, one in (({"tool_choice": "required"}, False), ({"parallel_tool_calls": False}, True)):
        grammar = _grammar(PLAIN, parser, **{"tool_choice": "required", **body})
        theirs = xgrammar.Grammar.from_ebnf(grammar.ebnf())
        lark = llguidance.LLMatcher.grammar_from_lark(_lark(CALL_FORMATS[parser], schemas, one))
        for name, text in samples.items():
            matcher = llguidance.LLMatcher(llt, lark, log_level=0)
            tokens = llt.tokenize_str(text)
            ours = matcher.validate_tokens(tokens) == len(tokens)
            ours = ours and matcher.consume_tokens(tokens) and matcher.is_accepting()
            assert ours == _is_grammar_accept_string(theirs, text), (body, name)


# --- walks under the masks ------------------------------------------------------------------

CASES = [  # (body, how many calls: None for one or more)
    ({"tool_choice": "required"}, None),
    ({"tool_choice": "required", "parallel_tool_calls": False}, 1),
    ({"tool_choice": RANGE_CHOICE}, 1),
]


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_random_walks_give_calls_that_validate(parser, case, tok, info, closers):
    body, count = CASES[case]
    spec = _grammar(GUIDED, parser, **body).spec()
    settings = {"tokenizer_info": info, "probe_steps": 8, "probe_mask_s": 1.0}
    answer = child._answer(None, settings, json.dumps(job_of(spec)).encode())
    assert answer == child.OK  # the compile child's check (in-process here)
    compiled = GrammarLoader(info).load(Prepared(spec))  # as a worker builds it
    assert isinstance(compiled, guidance.GuidanceGrammar)
    rng, counts = random.Random(case), set()
    for _ in range(8):
        out = walk(GrammarWindow(compiled), rng, {tok.eos_token_id}, 0.7, closers, 0.4, limit=600)
        content, calls = parse_tool_calls(tok.decode(out[:-1]), parser)
        assert not (content or "").strip() and calls, content
        for call in calls:
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[name])
            assert body["tool_choice"] == "required" or name == "set_range"
        counts.add(len(calls))
    assert counts == {1} if count == 1 else max(counts) > 1


@pytest.mark.parametrize("parser", PARSERS)
def test_stop_tokens_only_once_a_call_is_complete(parser, tok, info):
    grammar = _grammar(GUIDED, parser, tool_choice=RANGE_CHOICE)
    compiled = GrammarLoader(info).load(Prepared(grammar.spec()))
    fmt, eos = CALL_FORMATS[parser], tok.eos_token_id
    text = f'{fmt.tag_begin("set_range")}{{"lo": 3, "step": 1.5}}{fmt.end}'
    window = GrammarWindow(compiled)
    for token in tok.encode(text, add_special_tokens=False):
        assert not window.next_mask()[eos]
        window.commit([token])
    mask = window.next_mask()
    assert window.is_complete and mask.nonzero().flatten().tolist() == [eos]
    window.commit([eos])
    assert window.is_terminated
    required = GrammarLoader(info).load(
        Prepared(_grammar(GUIDED, parser, tool_choice="required").spec())
    )
    window = GrammarWindow(required)
    window.commit(tok.encode(text, add_special_tokens=False))
    mask = window.next_mask()  # a stop, or the next call
    assert mask[eos] and mask[tok.encode(fmt.separator[0], add_special_tokens=False)[0]]
