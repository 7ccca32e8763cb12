"""Structured outputs through the whole system (a spawned Engine, a draft that is often
rejected, both acceptance modes): greedy output under a JSON schema, a regex and a choice list
equals the target alone's greedy output under the same grammar (transformers with a logits
processor applying the same mask: xgrammar's, or llguidance's for an allOf schema xgrammar
would not enforce); every output of a set of schemas parses and validates; a bad grammar is a
ValueError naming the argument and the server goes on."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from runtime import Engine
from runtime.speculation.grammar.window import (
    GrammarCompiler,
    GrammarWindow,
    parse_structured_outputs,
)
from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(600)

NEW = 48
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ALL_OF = {  # two object schemas, both to hold (runtime.speculation.grammar.route: llguidance)
    "allOf": [
        {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {}},
            "required": ["n"],
            "additionalProperties": False,
        },
        {"properties": {"n": {"multipleOf": 3}, "ok": {"type": "boolean"}}, "required": ["ok"]},
    ]
}
CASES = [
    {"json": SCHEMA},
    {"regex": r"[a-z]{2,6}-[0-9]{1,3}"},
    {"choice": ["red", "green", "blue", "a much longer answer"]},
    {"json": ALL_OF},
    {"json": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
    {"lark": 'start: "id-" /[0-9]{2,4}/ (", " NAME)?\nNAME: /[a-z]{1,6}/'},
]  # SCHEMA (its maxLength), ALL_OF and the lark go to llguidance, the others to xgrammar
PROMPTS = ["Describe a person:", "Code:", "Pick a colour", "Count:", "Record:", "Key:"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar")
    target = checkpoints.build_with_tokenizer(root / "target", seed=0)
    other = checkpoints.build_with_tokenizer(root / "other", seed=1)
    return other, target


@pytest.fixture(scope="module")
def expected(pair) -> list[list[int]]:
    """Per case, the target's greedy tokens under its grammar: transformers' logits, the
    grammar's mask after each token (a fresh GrammarWindow: xgrammar's or llguidance's),
    stopping at EOS."""
    import transformers

    target = pair[1]
    tok = transformers.AutoTokenizer.from_pretrained(target)
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    eos = [tok.eos_token_id]
    with GrammarCompiler(tok, model.config.vocab_size, eos) as compiler:
        windows = [GrammarWindow(compiler.compile(parse_structured_outputs(c))) for c in CASES]
    return [_greedy(model, tok.encode(p), w, eos) for p, w in zip(PROMPTS, windows)]


@torch.no_grad()
def _greedy(model, ids: list[int], window: GrammarWindow, eos: list[int]) -> list[int]:
    out: list[int] = []
    for _ in range(NEW):
        logits = model(torch.tensor([ids + out])).logits[0, -1]
        out.append(int(logits.masked_fill(~window.next_mask(), float("-inf")).argmax()))
        if out[-1] in eos:
            break
        window.commit(out[-1:])
    return out


@pytest.mark.parametrize(
    "acceptance,mask_draft",
    [("tokens", True), ("logits", True), ("tokens", False), ("logits", False)],
)
def test_greedy_under_a_grammar_equals_target_alone(
    acceptance, mask_draft, pair, expected, tmp_path
):
    """mask_draft False: the draft proposes freely, off the grammar too; the target's
    verification alone holds the output to it."""
    draft, target = pair
    cfg = launch.write_config(tmp_path / "c.yaml", draft, target, ["cpu:0"], ["cpu:1"], 4)
    launch.set_speculation(cfg, acceptance=acceptance, mask_draft=mask_draft)
    with Engine.launch(cfg) as engine:
        for prompt, structured, want in zip(PROMPTS, CASES, expected):
            out = engine.generate(prompt, max_new_tokens=NEW, structured_outputs=structured)
            assert out.token_ids == want, structured
        if acceptance == "logits":  # sampled: masked or not, the draft's q is its own
            _every_output_validates(engine)
        if acceptance == "logits" and mask_draft:
            _bad_grammars_are_refused(engine)


def _every_output_validates(engine):
    """Schemas of several shapes, sampled: every output parses and fits its schema."""
    schemas = [
        SCHEMA,
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        {"type": "string", "enum": ["yes", "no", "maybe"]},
        {
            "type": "object",
            "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4}}},
            "required": ["tags"],
            "additionalProperties": False,
        },
        ALL_OF,  # xgrammar would not enforce it: llguidance does
    ]
    for i, schema in enumerate(schemas):
        outs = engine.generate(
            ["Answer:"] * 3, max_new_tokens=64, temperature=1.0, seed=i,
            structured_outputs={"json": schema},
        )  # fmt: skip
        for out in outs:
            assert out.finish_reason == "stop", (schema, out.text)
            jsonschema.validate(json.loads(out.text), schema)


def _bad_grammars_are_refused(engine):
    for bad, name in [
        ({"json": {"type": "nonsense"}}, "structured_outputs"),
        ({"regex": "(unclosed"}, "structured_outputs"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs"),
        ({"lark": "start: undefined_rule"}, "structured_outputs"),
        ({"json": {"type": "integer", "not": {"const": 3}}}, "structured_outputs: .* 'not'"),
    ]:
        with pytest.raises(ValueError, match=name):
            engine.generate("x", max_new_tokens=4, structured_outputs=bad)
    assert engine.generate("still here", max_new_tokens=2).token_ids  # the server goes on


COLOURS = {"choice": ["red", "green", "blue", "yellow", "grey"]}
SAMPLES = 2000


def constrained_joint(target: str, prompt: str) -> dict[tuple[int, int], float]:
    """P(first, second generated token) under the target alone at temperature 1 with the
    grammar's masks (the second: EOS when the first ends a choice)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(target)
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with GrammarCompiler(tok, model.config.vocab_size, [tok.eos_token_id]) as compiler:
        window = GrammarWindow(compiler.compile(parse_structured_outputs(COLOURS)))
    ids = tok.encode(prompt)
    joint = {}
    with torch.no_grad():
        first = model(torch.tensor([ids])).logits[0, -1]
        p1 = first.masked_fill(~window.next_mask(), float("-inf")).softmax(-1)
        for t1 in p1.nonzero()[:, 0].tolist():
            second = model(torch.tensor([ids + [t1]])).logits[0, -1]
            mask = window.masks([t1])[1]
            p2 = second.masked_fill(~mask, float("-inf")).softmax(-1)
            for t2 in p2.nonzero()[:, 0].tolist():
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


@pytest.mark.parametrize("mask_draft,verification", [(True, "token"), (False, "block")])
def test_sampling_under_a_grammar_follows_target_alone(mask_draft, verification, pair, tmp_path):
    """`logits` acceptance, a draft whose distribution differs (masked, or proposing freely:
    its q is then unmasked), verified token by token or as a block: the first two tokens
    under a choice grammar follow the target alone's constrained distribution (chi-square)."""
    from scipy import stats

    draft, target = pair
    cfg = launch.write_config(
        tmp_path / "c.yaml", draft, target, ["cpu:0"], ["cpu:1"], 3, max_batch_size=64
    )
    launch.set_speculation(
        cfg, acceptance="logits", mask_draft=mask_draft, verification=verification
    )
    with Engine.launch(cfg) as engine:
        outs = engine.generate(
            ["Colour:"] * SAMPLES, max_new_tokens=2, temperature=1.0, seed=11,
            structured_outputs=COLOURS,
        )  # fmt: skip
    want = constrained_joint(target, "Colour:")
    counts: dict[tuple[int, int], int] = {}
    for out in outs:
        key = (out.token_ids[0], out.token_ids[1])
        assert key in want, key  # never outside the grammar
        counts[key] = counts.get(key, 0) + 1
    cells = sorted(want, key=want.get, reverse=True)
    big = [c for c in cells if want[c] * SAMPLES >= 5]
    observed = [counts.get(c, 0) for c in big] + [SAMPLES - sum(counts.get(c, 0) for c in big)]
    expected = [want[c] * SAMPLES for c in big] + [SAMPLES * (1 - sum(want[c] for c in big))]
    keep = [i for i, e in enumerate(expected) if e > 0]
    p = stats.chisquare([observed[i] for i in keep], [expected[i] for i in keep]).pvalue
    assert p > 1e-3, (p, observed, expected)
    assert len(big) >= 3, "the grammar leaves too little to test"
