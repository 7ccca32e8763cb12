"""Which backend enforces a GrammarSpec: xgrammar (the default) or llguidance.

xgrammar 0.2.9 compiles some JSON-schema keywords without enforcing them: the output can then
fail to validate. A JSON schema goes to llguidance when it uses anything outside what xgrammar
was measured to enforce (a whitelist, walked over every subschema), so an unknown keyword is
llguidance's to enforce or refuse, never silently dropped. Routed to llguidance:

- keywords xgrammar ignores: not, if/then/else, uniqueItems (true), dependentRequired,
  dependentSchemas, dependencies, minContains, and any keyword not listed below;
- allOf with other than one subschema; $ref, anyOf, oneOf or allOf beside other keywords
  that constrain (xgrammar drops the siblings: {"type": "integer", "minimum": 0, "anyOf":
  [...]} accepts -5);
- multipleOf except an integer one on type integer (0.5 on a number is ignored);
- minLength/maxLength: xgrammar's counted string lets raw control characters in (invalid
  JSON: {"maxLength": 8} accepts "a\x1c"), and ignores the lengths beside pattern or format;
- required naming a key absent from the same node's properties ({"type": "object",
  "required": ["a"]} accepts {}; an anyOf of bare required lists likewise).

oneOf stays on xgrammar, which enforces it as anyOf: exact for disjoint branches (the usual
case; llguidance refuses many of those, e.g. oneOf [$ref, null]). Annotations (title,
description, default, examples, $comment, OpenAPI's discriminator, x-... extensions) constrain
nothing. A pure function of the spec: rank 0 and every worker route alike. A "lark" spec
(internal: runtime.api.tools.grammar, for forced tool calls) is llguidance's alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from runtime.speculation.grammar.spec import GrammarSpec

# the JSON layout of llguidance's grammars, as xgrammar's (", " and ": ", no other whitespace):
# its overrides of a schema's "x-guidance" (grammar.guidance, the Lark of forced tool calls)
GUIDANCE_JSON_OPTIONS: Any = {  # llguidance.JsonCompileOptions (not imported here)
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}
ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$schema", "$id", "$comment",
        "$anchor", "deprecated", "readOnly", "writeOnly", "contentEncoding",
        "contentMediaType", "$defs", "definitions", "discriminator",
    }
)  # fmt: skip  # and vendor extensions: x-...
ENFORCED = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "patternProperties",
        "propertyNames", "minProperties", "maxProperties", "unevaluatedProperties", "items",
        "prefixItems", "minItems", "maxItems", "contains", "maxContains", "unevaluatedItems",
        "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
        "multipleOf", "minLength", "maxLength", "pattern", "format", "nullable", "uniqueItems",
        "$ref", "anyOf", "oneOf", "allOf",
    }
)  # fmt: skip
COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = (
    "items", "additionalProperties", "propertyNames", "contains", "unevaluatedProperties",
    "unevaluatedItems", "additionalItems", "not", "if", "then", "else",
)  # fmt: skip


def uses_guidance(spec: GrammarSpec) -> bool:
    """Whether llguidance enforces this spec: a JSON schema xgrammar would not enforce, or
    llguidance's own Lark (a forced tool call whose parameters need it)."""
    if spec.kind == "lark":
        return True
    return bool(spec.kind == "json" and guidance_reasons(json.loads(spec.text)))


def guidance_reasons(schema: Any) -> list[str]:
    """What in `schema` xgrammar does not enforce (sorted, each once; a keyword itself where
    xgrammar ignores it outright, else a phrase); [] for none."""
    reasons: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, Mapping):
            continue  # true / false (or a malformed schema, left to the compilers)
        reasons.update(_node_reasons(node))
        stack.extend(_subschemas(node))
    return sorted(reasons)


def _node_reasons(node: Mapping) -> list[str]:
    """What in this one node (its own keywords, not its subschemas') xgrammar ignores."""
    reasons = [str(k) for k in node if k not in ENFORCED and not _annotation(k)]
    if node.get("uniqueItems", False) is not False:
        reasons.append("uniqueItems")
    allof = node.get("allOf")
    if allof is not None and (not isinstance(allof, list) or len(allof) != 1):
        reasons.append("allOf of several subschemas")
    present = [c for c in COMBINATORS if c in node]
    if present and (len(present) > 1 or any(not _annotation(k) for k in node if k != present[0])):
        reasons.append(f"keywords beside {present[0]}")
    if "multipleOf" in node and not _integer_multiple(node):
        reasons.append("multipleOf on a number")
    if "minLength" in node or "maxLength" in node:
        reasons.append("minLength/maxLength")
    required, properties = node.get("required"), node.get("properties")
    if isinstance(required, list) and required:
        known = properties if isinstance(properties, Mapping) else {}
        if any(name not in known for name in required):
            reasons.append("required keys outside properties")
    return reasons


def _annotation(key: Any) -> bool:
    return key in ANNOTATIONS or (isinstance(key, str) and key.startswith("x-"))


def _integer_multiple(node: Mapping) -> bool:
    kind, step = node.get("type"), node.get("multipleOf")
    kinds = kind if isinstance(kind, list) else [kind]
    return "integer" in kinds and "number" not in kinds and type(step) is int


def _subschemas(node: Mapping) -> list[Any]:
    """The schemas directly inside a node (not enum/const/default/examples: data)."""
    found: list[Any] = []
    for key in _SCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, Mapping):
            found.extend(value.values())
    for key in _SCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            found.extend(value)
    for key in _SCHEMA_VALUES:
        value = node.get(key)
        found.extend(value if isinstance(value, list) else [value])
    dependencies = node.get("dependencies")
    if isinstance(dependencies, Mapping):
        found.extend(v for v in dependencies.values() if isinstance(v, Mapping))
    return found
