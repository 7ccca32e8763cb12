"""Structured outputs on llguidance (runtime.speculation.grammar.route, grammar.guidance): which
JSON schemas go to llguidance (what xgrammar 0.2.9 would not enforce), refusals naming what
neither backend enforces, random walks under the masks always giving valid instances, masks
over a window equal to one token at a time, stop tokens as xgrammar's, a mid-generation error
raised, and the workers' llguidance vocabulary equal to the tokenizer's bytes. SmolLM2's
tokenizer (49,152 tokens) throughout."""

from __future__ import annotations

import itertools
import json
import random

import jsonschema
import llguidance.hf
import pytest
import torch
import xgrammar as xgr

from runtime.speculation.grammar import guidance
from runtime.speculation.grammar.guidance import GuidanceError, GuidanceGrammar
from runtime.speculation.grammar.route import guidance_reasons, uses_guidance
from runtime.speculation.grammar.window import (
    GrammarLoader,
    GrammarSpec,
    GrammarWindow,
    parse_structured_outputs,
    tokenizer_info,
)
from tests.grammar_walks import walk

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
XGRAMMAR = [  # what xgrammar enforces: stays there
    OBJ,
    {**OBJ, "required": ["a"], "additionalProperties": False, "title": "t", "x-kind": 1},
    {"$defs": {"n": {"type": "integer"}}, "allOf": [{"$ref": "#/$defs/n"}], "description": "d"},
    {"anyOf": [{"$ref": "#/definitions/n"}, {"type": "null"}], "default": None},
    {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "minProperties": 1},
    {"type": "string", "format": "email"},
    {"type": "string", "pattern": "^a+$"},
    {"type": "integer", "minimum": 0, "exclusiveMaximum": 9, "multipleOf": 3},
    {"type": ["integer", "null"], "multipleOf": 2},
    {"type": "array", "contains": {"type": "integer"}, "maxContains": 2, "uniqueItems": False},
    {"type": "array", "prefixItems": [{"const": 1}], "items": False, "maxItems": 3},
    {"type": "object", "propertyNames": {"pattern": "^a"}, "unevaluatedProperties": False},
    {"enum": [{"not": 1}, {"allOf": [1, 2]}], "examples": [{"if": 1}]},  # data, not schemas
    {"type": "object", "properties": {"not": {"type": "string"}, "if": {}}, "required": ["not"]},
    {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    {"type": "object", "properties": {"p": {"oneOf": [{"$ref": "#/$defs/a"}]}}, "$defs": {}},
    {"type": "string", "nullable": True, "contentEncoding": "base64"},
    {"type": "object", "properties": {"p": {"oneOf": []}, "discriminator": {}}},
]
GUIDANCE = [  # (schema, why): what xgrammar ignores goes to llguidance
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf of several subschemas"),
    ({"allOf": [{**OBJ, "required": ["a"]}, {**OBJ, "required": ["b"]}]}, "allOf of several"),
    ({"type": "integer", "allOf": [{"minimum": 3}]}, "keywords beside allOf"),
    ({"type": "integer", "minimum": 0, "anyOf": [{"maximum": 3}]}, "keywords beside anyOf"),
    ({"$ref": "#/$defs/n", "maximum": 5, "$defs": {"n": {}}}, "keywords beside \\$ref"),
    ({"type": "integer", "not": {"const": 3}}, "not"),
    ({"if": {"type": "integer"}, "then": {"minimum": 3}, "else": {}}, "if"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "dependentSchemas": {"a": {}}}, "dependentSchemas"),
    ({"type": "object", "dependencies": {"a": ["b"]}}, "dependencies"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf on a number"),
    ({"type": "integer", "multipleOf": 1.5}, "multipleOf on a number"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "minLength/maxLength"),
    ({"type": "string", "format": "email", "minLength": 3}, "minLength/maxLength"),
    ({"type": "string", "minLength": 2, "maxLength": 5}, "minLength/maxLength"),
    ({**OBJ, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "required keys outside"),
    ({"type": "object", "required": ["a"]}, "required keys outside properties"),
    ({"type": "array", "contains": {}, "minContains": 2}, "minContains"),
    ({"type": "array", "items": {"type": "object", "properties": {"n": {"not": {}}}}}, "not"),
    ({"$defs": {"d": {"type": "array", "uniqueItems": True}}, "$ref": "#/$defs/d"}, "unique"),
    ({"type": "object", "properties": {"p": {"oneOf": [{"not": {}}]}}}, "not"),
]


def compile_json(compiler, schema) -> GuidanceGrammar:
    compiled = compiler.compile(parse_structured_outputs({"json": schema}))
    assert isinstance(compiled, GuidanceGrammar)
    return compiled


# --- routing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("schema", XGRAMMAR)
def test_what_xgrammar_enforces_stays_on_xgrammar(schema):
    assert guidance_reasons(schema) == []
    assert not uses_guidance(parse_structured_outputs({"json": schema}))


@pytest.mark.parametrize("schema,why", GUIDANCE)
def test_what_xgrammar_ignores_goes_to_llguidance(schema, why):
    assert any(reason.startswith(why.replace("\\", "")) for reason in guidance_reasons(schema))
    assert uses_guidance(parse_structured_outputs({"json": schema}))


def test_other_kinds_stay_on_xgrammar(compiler):
    for value in [{"regex": "a+"}, {"choice": ["not"]}, {"json_object": True}]:
        assert not uses_guidance(parse_structured_outputs(value))
    assert not uses_guidance(GrammarSpec("grammar", 'root ::= "not"'))
    compiled = compiler.compile(parse_structured_outputs({"json": OBJ}))
    assert isinstance(compiled, xgr.CompiledGrammar)


# --- refusals --------------------------------------------------------------------------------

REFUSED = [
    ({"type": "integer", "not": {"const": 3}}, "uses 'not', which neither xgrammar nor llguidance"),
    ({"if": {"type": "integer"}, "then": {"minimum": 3}}, "uses 'if', 'then', which neither"),
    ({"type": "array", "uniqueItems": True}, "uses 'uniqueItems', which neither"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "uses 'dependentRequired', which"),
    ({"type": "object", "dependencies": {"a": ["b"]}}, "uses 'dependencies', which neither"),
    (
        {"type": "array", "contains": {}, "allOf": [{"minItems": 1}, {"maxItems": 3}]},
        "uses 'contains', which llguidance does not enforce, with allOf of several subschemas, "
        "keywords beside allOf, which xgrammar does not enforce",
    ),
    (
        {"allOf": [{"type": "string", "format": "zzz"}, {"maxLength": 3}]},
        "needs llguidance \\(xgrammar does not enforce allOf of several subschemas, "
        "'minLength/maxLength'\\), which "
        "refuses it: Unknown format: zzz",
    ),
    (
        {"type": "number", "multipleOf": 0.5, "oneOf": [{"type": "integer"}, {"minimum": 3}]},
        "needs llguidance \\(xgrammar does not enforce keywords beside oneOf, multipleOf on a "
        "number\\), which refuses it: oneOf constraints are not supported",
    ),
]


@pytest.mark.parametrize("schema,message", REFUSED)
def test_refusals_name_the_argument_and_the_reason(compiler, schema, message):
    with pytest.raises(ValueError, match=f"^structured_outputs: the schema {message}"):
        compiler.prepare(parse_structured_outputs({"json": schema}))


# --- masks -----------------------------------------------------------------------------------

WALKED = [
    {  # allOf of two object schemas: properties and required lists merge
        "allOf": [
            {**OBJ, "required": ["a"]},
            {
                "type": "object",
                "properties": {"a": {"minimum": 3, "maximum": 40}, "b": {"maxLength": 3}},
                "required": ["b"],
                "additionalProperties": False,  # llguidance allows others by default
            },
        ]
    },
    {
        "type": "object",
        "properties": {"x": {"type": "number", "multipleOf": 0.25, "minimum": -5, "maximum": 5}},
        "required": ["x"],
        "additionalProperties": False,
    },
    {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$", "minLength": 2, "maxLength": 6},
    {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
        "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
        "additionalProperties": False,
    },
    {
        "$defs": {"n": {"type": "integer", "minimum": 0}},
        "type": "array",
        "items": {"allOf": [{"$ref": "#/$defs/n"}, {"maximum": 20}, {"multipleOf": 3}]},
        "maxItems": 3,
    },
]


@pytest.mark.parametrize("index", range(len(WALKED)))
def test_random_walks_under_the_masks_validate(compiler, tok, index):
    schema = WALKED[index]
    compiled = compile_json(compiler, schema)
    rng = random.Random(index)
    for _ in range(20):
        out = walk(GrammarWindow(compiled), rng, {tok.eos_token_id})
        text = tok.decode(out[:-1], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)


def test_window_masks_equal_one_token_at_a_time(compiler, tok):
    schema = WALKED[0]
    compiled = compile_json(compiler, schema)
    tokens = [*tok.encode('{"a": 17, "b": "x\\"y"}', add_special_tokens=False), tok.eos_token_id]
    fresh, rows = GrammarWindow(compiled), []
    for token in tokens:
        rows.append(fresh.next_mask())
        fresh.commit([token])
    reference = torch.stack([*rows, fresh.next_mask()])
    window = GrammarWindow(compiled)
    done, sizes = 0, itertools.cycle((3, 1, 4, 0, 2, 6))
    while done < len(tokens):
        proposals = tokens[done : done + next(sizes)]
        assert torch.equal(window.masks(proposals), reference[done : done + len(proposals) + 1])
        keep = tokens[done : done + max(1, len(proposals) - 1)]
        window.commit(keep)
        done += len(keep)
    assert window.is_terminated and window.next_mask().all()
    window = GrammarWindow(compiled)
    bad = tok.encode("]", add_special_tokens=False)[0]
    masks = window.masks([*tokens[:3], bad, *tokens[3:6]])
    assert torch.equal(masks[:4], reference[:4]) and not masks[3, bad] and masks[4:].all()
    with pytest.raises(ValueError, match="not allowed"):
        window.commit([tokens[0], bad])
    assert torch.equal(window.next_mask(), reference[0]) and window.pending == 0


def test_stop_tokens_as_xgrammar(tok):
    vocab = len(tok) + 64  # logits wider than the tokenizer: the padding is never allowed
    info = tokenizer_info(tok, vocab, stop_token_ids=[2, 0])
    llt = guidance.guidance_tokenizer(info)
    schema = json.dumps({"allOf": [{"type": "integer"}, {"minimum": 3}]})
    compiled = guidance.validate(llt, schema, info.stop_token_ids)
    assert isinstance(compiled, GuidanceGrammar) and compiled.vocab_size == vocab
    window = GrammarWindow(compiled)
    mask = window.next_mask()
    assert mask.shape == (vocab,) and not mask[:17].any() and not mask[len(tok) :].any()
    window.commit(tok.encode("4", add_special_tokens=False))
    mask = window.next_mask()
    assert window.is_complete and mask[[0, 2]].all() and not mask[[1, *range(3, 17)]].any()
    assert not window.advance(1) and window.pending == 1
    window.rollback(1)
    window.commit([0])
    assert window.is_terminated and window.is_complete and window.next_mask().all()
    with pytest.raises(ValueError, match="not allowed"):
        window.commit([2])
    other = GrammarWindow(compiled, stop_token_ids=[5, 7])  # the window's own stop tokens
    other.commit(tok.encode("12", add_special_tokens=False))
    assert other.next_mask()[[5, 7]].all() and not other.next_mask()[[0, 2]].any()
    assert not other.advance(0)
    other.rollback(1)
    assert other.advance(7) and other.is_terminated
    other.rollback(1)  # a stop token rolls back like any other
    assert not other.is_terminated and other.next_mask()[7]
    assert not GrammarWindow(compiled).advance(0)  # not complete yet: no stop


def test_an_error_mid_generation_fails_the_window(compiler, tok, monkeypatch):
    """A matcher past its fuel: never a wrong mask. The window is failed for good (its
    reason kept), every mask from there allows only the stop tokens (the request ends), and
    the worker's book reports it for its slot; a broken grammar: GuidanceError at once."""
    from runtime.speculation.grammar.book import GrammarBook

    schema = {"type": "string", "pattern": "^(a|b)*c(a|b){20}$", "maxLength": 80}
    compiled = compile_json(compiler, schema)
    monkeypatch.setitem(guidance.LIMITS, "max_lexer_states", 5)
    window = GrammarWindow(compiled)
    window.commit(tok.encode('"abab', add_special_tokens=False))  # the lexer grows past its limit
    masks = window.masks(tok.encode("ab", add_special_tokens=False))
    assert window.failure and window.failure.startswith(
        "llguidance's matcher failed: lexer error: too many"
    )
    stops = torch.zeros(len(masks[0]), dtype=torch.bool)
    stops[compiled.stop_token_ids[0]] = True
    assert all(torch.equal(m, stops) for m in masks) and window.is_terminated
    window.commit([compiled.stop_token_ids[0]])  # the round's stop token: taken, no error
    book = GrammarBook(torch.device("cpu"))
    book.windows[3] = window
    assert book.failures([1, 3]) == ["", window.failure] and book.failures([1]) is None
    monkeypatch.undo()
    broken = GuidanceGrammar(compiled.tokenizer, "{", compiled.vocab_size, (2,))
    with pytest.raises(GuidanceError, match="matcher failed"):
        GrammarWindow(broken)


# --- the workers' side -----------------------------------------------------------------------


def test_the_workers_vocabulary_is_the_tokenizers(tok):
    """Built from the TokenizerInfo JSON rank 0 sends: each token's bytes are the tokenizer's
    (llguidance's own reading of the HF tokenizer); specials and stops are never text."""
    sent = tokenizer_info(tok, len(tok)).serialize_json()
    info = xgr.TokenizerInfo.deserialize_json(sent)
    ours = guidance.guidance_tokenizer(info)
    theirs = llguidance.hf.from_tokenizer(tok)
    special = {*info.special_token_ids, *info.stop_token_ids}
    assert ours.vocab_size == len(tok) and special
    for token in range(len(tok)):
        if token in special:
            assert ours.is_special_token(token)
        else:
            assert ours.decode_bytes([token]) == theirs.decode_bytes([token]), token
    text = 'héllo {"a": [1, 2.5]}\n\t日本'
    assert ours.decode_bytes(tok.encode(text, add_special_tokens=False)) == text.encode()


def test_workers_rebuild_identical_grammars(compiler, tok):
    spec = parse_structured_outputs({"json": WALKED[3]})
    compiled = compiler.compile(spec)
    prepared = compiler.prepare(spec)
    assert prepared.wire is None  # built again by each worker: a millisecond
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info(tok, len(tok)).serialize_json())
    rebuilt = GrammarLoader(info).load(prepared)
    assert isinstance(rebuilt, GuidanceGrammar) and rebuilt is not compiled
    tokens = tok.encode('{"a": true}', add_special_tokens=False)
    assert torch.equal(GrammarWindow(rebuilt).masks(tokens), GrammarWindow(compiled).masks(tokens))
