"""Structured outputs (runtime.speculation.grammar): parsing and its errors, bounded compiles,
the wire form, a window's masks against a fresh matcher advancing one token at a time, and a
tiny random model's greedy decode under JSON schemas, plainly and speculatively, always giving
JSON that validates. SmolLM2's tokenizer (49,152 tokens) throughout."""

from __future__ import annotations

import itertools
import json
import random
import time

import numpy as np
import pytest
import torch
import xgrammar as xgr

from runtime.speculation.grammar.spec import MAX_REPEAT, MAX_SPEC_CHARS
from runtime.speculation.grammar.window import (
    GrammarLoader,
    GrammarSpec,
    GrammarWindow,
    Prepared,
    from_wire,
    parse_structured_outputs,
    to_wire,
    tokenizer_info,
    unpack_bitmask,
)
from runtime.speculation.processors import NEG_INF, Processing, process
from tests.checkpoints import build_with_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,  # xgrammar's strict mode implies it, llguidance does not
}
# SCHEMA's string lengths route it to llguidance (grammar.route); this one stays on xgrammar
XGRAMMAR_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age"],
}
CASES = {  # a spec and an output it allows
    "json": ({"json": XGRAMMAR_SCHEMA}, '{"name": "Ada", "age": 36, "tags": ["ma\\"th", "é\\n"]}'),
    "regex": ({"regex": r"[a-z]+@[a-z]+\.(com|org)"}, "ada@example.org"),
    "choice": ({"choice": ["yes", "no", "maybe not"]}, "maybe not"),
    "grammar": ({"grammar": 'root ::= "(" [0-9]+ ")"'}, "(1234)"),
}


def reference_masks(compiled, tokens: list[int], vocab: int) -> torch.Tensor:
    """A fresh matcher's masks before each token and after the last (numpy's unpacking; all
    True after a stop token)."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    rows = []
    for token in [*tokens, None]:
        if matcher.is_terminated():
            bitmask.fill_(-1)
        else:
            matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab]
        rows.append(torch.from_numpy(bits.astype(bool)))
        if token is not None:
            assert matcher.accept_token(token)
    return torch.stack(rows)


# --- parsing ---------------------------------------------------------------------------------


def test_parse_each_kind():
    spec = parse_structured_outputs({"json": SCHEMA})
    assert spec.kind == "json" and json.loads(spec.text) == SCHEMA
    assert list(json.loads(spec.text)["properties"]) == ["name", "age", "tags"]  # order kept
    assert parse_structured_outputs({"json": json.dumps(SCHEMA)}) == spec
    assert parse_structured_outputs({"regex": "a+"}) == GrammarSpec("regex", "a+")
    assert parse_structured_outputs({"choice": ["a", "b"]}).text == '["a", "b"]'
    assert parse_structured_outputs({"grammar": 'root ::= "a"'}).kind == "grammar"
    assert parse_structured_outputs({"json_object": True}) == GrammarSpec("json_object", "")


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    "value",
    [
        None,
        {},
        {"json": SCHEMA, "regex": "a"},
        {"structural_tag": {}},
        {"json": [1]},
        {"json": "{not json"},
        {"json": "[1]"},
        {"json": {"enum": [float("nan")]}},
        {"choice": []},
        {"choice": ["a", 1]},
        {"choice": "a"},
        {"regex": 5},
        {"grammar": " "},
        {"json_object": False},
        {"regex": "a" * (MAX_SPEC_CHARS + 1)},
        {"regex": f"a{{1,{MAX_REPEAT + 1}}}"},
        {"json": nested(10_000)},  # refused before Python's recursion limit
        {"json": "[" * 100_000},
        {"json": {"type": "object", "properties": {f"p{i}": {} for i in range(300)}}},
        {"json": {"anyOf": [{"properties": {"p": {}}, "required": ["p"]}] * 2100}},
    ],
)
def test_bad_structured_outputs(value):
    with pytest.raises(ValueError, match=r"^structured_outputs: "):
        parse_structured_outputs(value)


# --- compiling, its bounds and its cache -----------------------------------------------------


@pytest.mark.parametrize(
    "value", [{"regex": "(ab"}, {"grammar": "root ::= "}, {"json": {"type": "foo"}}]
)
def test_compile_errors_name_the_argument(compiler, value):
    with pytest.raises(ValueError, match=r"^structured_outputs: the \w+ does not compile: "):
        compiler.compile(parse_structured_outputs(value))


def test_slow_masks_are_refused(compiler):
    """Nested ambiguous repetitions compile fast but each mask takes 0.2 s, then more."""
    start = time.monotonic()
    with pytest.raises(ValueError, match="masks are too slow"):
        compiler.compile(parse_structured_outputs({"regex": "(.{1,30}){1,30}"}))
    assert time.monotonic() - start < 30  # the child's first start included, on a busy CI


def test_an_explosive_compile_is_cut_off_and_the_compiler_recovers(compiler, monkeypatch):
    """This schema compiles for over two minutes: the child is killed at the time limit, the
    refusal is cached, and a fresh child compiles what comes next."""
    monkeypatch.setattr(compiler, "timeout_s", 1.0)
    spec = parse_structured_outputs({"json": {"type": "string", "pattern": "(.{1,30}){1,30}"}})
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^structured_outputs: compiling took longer than 1 s"):
        compiler.compile(spec)
    assert time.monotonic() - start < 15
    start = time.monotonic()
    with pytest.raises(ValueError, match="took longer"):
        compiler.compile(spec)
    assert time.monotonic() - start < 0.1
    monkeypatch.undo()
    assert compiler.compile(parse_structured_outputs({"regex": "[0-9]+"})) is not None


def test_cache_keeps_the_latest(compiler, monkeypatch):
    specs = [parse_structured_outputs({"choice": [f"c{i}"]}) for i in range(3)]
    first = compiler.prepare(specs[0])
    assert compiler.prepare(specs[0]) is first and first.wire is None  # compiled in ms
    monkeypatch.setattr(compiler, "_cache_size", 2)
    compiler.prepare(specs[1])
    compiler.prepare(specs[2])
    assert specs[0] not in compiler._cache and compiler.prepare(specs[0]) is not first


# --- windows ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(CASES))
def test_window_masks_equal_one_token_at_a_time(compiler, tok, kind):
    value, text = CASES[kind]
    compiled = compiler.compile(parse_structured_outputs(value))
    tokens = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    reference = reference_masks(compiled, tokens, len(tok))
    window = GrammarWindow(compiled)
    done, sizes = 0, itertools.cycle((3, 1, 4, 0, 2, 6))
    while done < len(tokens):  # rounds: masks over proposals, then commit all but the last
        proposals = tokens[done : done + next(sizes)]
        assert torch.equal(window.masks(proposals), reference[done : done + len(proposals) + 1])
        keep = tokens[done : done + max(1, len(proposals) - 1)]
        window.commit(keep)
        done += len(keep)
    assert window.is_terminated and window.next_mask().all()  # after the grammar's end


def test_after_a_disallowed_proposal_masks_are_all_true(compiler, tok):
    compiled = compiler.compile(parse_structured_outputs({"json": XGRAMMAR_SCHEMA}))
    tokens = tok.encode('{"name": "x"', add_special_tokens=False)
    bad = tok.encode("}", add_special_tokens=False)[0]
    proposals = [*tokens[:3], bad, *tokens[3:]]
    masks = GrammarWindow(compiled).masks(proposals)
    assert torch.equal(masks[:4], reference_masks(compiled, tokens[:3], len(tok)))
    assert not masks[3, bad] and masks[4:].all()


def test_rollback_restores_the_state(compiler, tok):
    compiled = compiler.compile(parse_structured_outputs({"json": XGRAMMAR_SCHEMA}))
    tokens = tok.encode('{"name": "Bo", "age": 7}', add_special_tokens=False)
    window = GrammarWindow(compiled)
    window.commit(tokens[:2])
    before = window.next_mask()
    assert all(window.advance(t) for t in tokens[2:6]) and not window.advance(tokens[0])
    assert window.pending == 5 and not torch.equal(window.next_mask(), before)
    window.rollback(3)
    assert torch.equal(window.next_mask(), reference_masks(compiled, tokens[:4], len(tok))[-1])
    window.rollback(2)
    assert torch.equal(window.next_mask(), before) and window.pending == 0
    with pytest.raises(ValueError, match="not allowed"):
        window.commit([tokens[2], tokens[0]])  # the second breaks the grammar: nothing taken
    assert torch.equal(window.next_mask(), before)


def test_stop_tokens_end_the_grammar_and_specials_are_never_allowed(tok):
    vocab = len(tok) + 64  # logits wider than the tokenizer: the padding is never allowed
    info = tokenizer_info(tok, vocab, stop_token_ids=[2, 0])
    compiled = xgr.GrammarCompiler(info).compile_grammar('root ::= "yes" | "y" [0-9]*')
    window = GrammarWindow(compiled)
    window.commit(tok.encode("y", add_special_tokens=False))
    mask = window.next_mask()
    assert mask.shape == (vocab,) and mask[[0, 2]].all() and not mask[[1, *range(3, 17)]].any()
    assert not mask[len(tok) :].any() and window.is_complete
    window.commit(tok.encode("es", add_special_tokens=False))
    assert window.next_mask().nonzero().flatten().tolist() == [0, 2]
    window.commit([0])
    assert window.is_terminated
    with pytest.raises(ValueError, match="not allowed"):
        window.commit([tok.encode("a", add_special_tokens=False)[0]])


def test_workers_rebuild_identical_grammars(compiler, tok):
    """A worker's loader, from the spec (a fast compile) or from the wire form: the same
    masks as the orchestrator's."""
    spec = parse_structured_outputs({"json": XGRAMMAR_SCHEMA})
    compiled = compiler.compile(spec)
    data = to_wire(compiled)
    assert isinstance(data, bytes) and len(data) < 100_000
    worker_info = tokenizer_info(tok, len(tok))  # a worker builds its own
    tokens = tok.encode(CASES["json"][1], add_special_tokens=False)
    expected = GrammarWindow(compiled).masks(tokens)
    for prepared in (compiler.prepare(spec), Prepared(spec, data)):
        rebuilt = GrammarLoader(worker_info).load(prepared)
        assert rebuilt is not compiled
        assert torch.equal(GrammarWindow(rebuilt).masks(tokens), expected)
    with pytest.raises(ValueError):
        from_wire(data, tokenizer_info(tok, len(tok) + 64))  # another vocabulary
    with pytest.raises(ValueError):
        from_wire(b"garbage", worker_info)


# --- masks on scores -------------------------------------------------------------------------


def masked(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """scores [B, n, V] under a grammar mask [B, n, V'], as every sampled position applies
    it: the logits processors (runtime.speculation.processors.process), nothing else on."""
    index = torch.zeros(scores.shape[:2], dtype=torch.long)
    return process(scores, Processing(), index, mask=mask)


def test_unpack_and_apply_masks():
    words = torch.randint(-(2**31), 2**31 - 1, (2, 3, 4), dtype=torch.int32)
    mask = unpack_bitmask(words, 100)
    assert mask.shape == (2, 3, 100)
    for b, n, t in [(0, 0, 0), (1, 2, 31), (0, 1, 32), (1, 0, 99), (0, 2, 64)]:
        assert bool(mask[b, n, t]) == bool((int(words[b, n, t // 32]) >> (t % 32)) & 1)
    scores = torch.randn(2, 3, 104)
    out = masked(scores, mask)  # ids 100..103 past the mask: disallowed
    assert torch.equal(out[..., :100][mask], scores[..., :100][mask])
    assert out[..., :100][~mask].eq(NEG_INF).all() and out[..., 100:].eq(NEG_INF).all()
    assert torch.equal(masked(scores[..., :50], mask), out[..., :50])  # a wider mask is cut


# --- a model decoding under JSON schemas -----------------------------------------------------


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object whose every output is short, so that a random model always finishes one."""
    if depth > 0:
        kind = rng.choice(["integer", "boolean", "enum", "string", "array", "anyOf", "object"])
    if depth == 0 or (kind == "object" and depth < 3):
        names = rng.sample(["id", "name", "ok", "items", "x"], rng.randint(1, 3))
        return {
            "type": "object",
            "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": [n for n in names if rng.random() < 0.5],
            "additionalProperties": False,  # llguidance would allow others (xgrammar: not)
        }
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 'q"uote', "ü", 7, None], 3)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "array":
        items = random_schema(rng, depth + 1)
        return {"type": "array", "items": items, "maxItems": rng.randint(0, 3)}
    if kind == "anyOf":
        return {"anyOf": [{"type": "null"}, random_schema(rng, depth + 1)]}
    return {"type": "boolean"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_with_tokenizer(tmp_path_factory.mktemp("grammar-model"), seed=3)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def decode(model, window: GrammarWindow, prompt: list[int], eos: int) -> list[int]:
    """Masked greedy decode, one token at a time."""
    out: list[int] = []
    while len(out) < 200 and (not out or out[-1] != eos):
        logits = model(torch.tensor([prompt + out]), logits_to_keep=1).logits
        out.append(int(masked(logits, window.next_mask()[None, None]).argmax()))
        window.commit(out[-1:])
    return out


@torch.no_grad()
def speculate(model, window: GrammarWindow, prompt: list[int], hint: list[int], k: int):
    """Masked greedy decode in speculative rounds. The draft (no model: random scores, most
    often topped by `hint`'s token, the plain decode's, so that it is often right) proposes
    k tokens under its own masks (next_mask, advance, rollback); the model verifies them
    under the window's masks over the proposals, keeps the agreeing prefix and its own next
    token."""
    out: list[int] = []
    gen = torch.Generator().manual_seed(k)
    while len(out) < len(hint) and out[-1:] != hint[-1:]:
        proposals: list[int] = []
        for j in range(k):
            scores = torch.randn(1, 1, window.vocab_size, generator=gen)
            if torch.rand(1, generator=gen) < 0.7:
                scores[..., hint[min(len(out) + j, len(hint) - 1)]] += 10.0
            proposals.append(int(masked(scores, window.next_mask()[None, None]).argmax()))
            window.advance(proposals[-1])
        window.rollback(k)
        logits = model(torch.tensor([prompt + out + proposals]), logits_to_keep=k + 1).logits
        choice = masked(logits, window.masks(proposals)[None]).argmax(-1)[0].tolist()
        n = next((i for i, (p, c) in enumerate(zip(proposals, choice)) if p != c), k)
        new = [*proposals[:n], choice[n]]
        new = new[: new.index(hint[-1]) + 1] if hint[-1] in new else new
        window.commit(new)
        out += new
    return out


@pytest.fixture
def one_thread():
    """The tiny model's matrices are small: two threads on a busy machine are 100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_greedy_decode_under_json_schemas_always_validates(compiler, tok, model, one_thread):
    jsonschema = pytest.importorskip("jsonschema")
    rng = random.Random(0)
    schemas = [SCHEMA] + [random_schema(rng) for _ in range(11)]
    prompt = tok.encode("Reply in JSON:", add_special_tokens=False)
    for schema in schemas:
        compiled = compiler.compile(parse_structured_outputs({"json": schema}))
        plain = decode(model, GrammarWindow(compiled), prompt, tok.eos_token_id)
        assert plain[-1] == tok.eos_token_id, (schema, tok.decode(plain))
        value = json.loads(tok.decode(plain[:-1], skip_special_tokens=True))
        jsonschema.validate(value, schema)
        for k in (1, 4):
            assert speculate(model, GrammarWindow(compiled), prompt, plain, k) == plain, schema
