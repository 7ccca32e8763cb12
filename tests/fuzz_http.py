"""Schemathesis over a served API (tests/e2e): it reads /openapi.json and posts bodies that
its schemas describe to each generating route, checking that no answer is a 5xx, that each
status, content type and JSON answer is one the schema documents, and that none hangs."""

from __future__ import annotations

import collections
import time

FUZZ_EXAMPLES = 40  # bodies per route (the same ones every run: derandomized)
FUZZ_BUDGET_S = 60.0  # both routes together; examples left after it are skipped
FUZZ_MAX_TOKENS = 4  # generation stays short: what is fuzzed is the front, not the engine
ROUTES = ("/v1/completions", "/v1/chat/completions")


def _bounded(case, model: str) -> None:
    """A fuzzed body made cheap to serve: the served model, at most FUZZ_MAX_TOKENS new
    tokens, 2 choices and 3 prompts (refused values stay refused)."""
    body = case.body
    if not isinstance(body, dict):
        return
    body["model"] = model
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(name), int) and not isinstance(body[name], bool):
            body[name] = min(body[name], FUZZ_MAX_TOKENS)
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
        body["n"] = min(body["n"], 2)
    if isinstance(body.get("prompt"), list):
        body["prompt"] = body["prompt"][:3]


def fuzz(base: str, model: str) -> collections.Counter:
    """The statuses of the fuzzed bodies posted to `base` (the server's root URL)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import checks

    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    validations = [
        checks.not_a_server_error,
        checks.status_code_conformance,
        checks.content_type_conformance,
        checks.response_schema_conformance,
    ]
    deadline = time.monotonic() + FUZZ_BUDGET_S
    statuses: collections.Counter = collections.Counter()
    for path in ROUTES:

        @settings(
            max_examples=FUZZ_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=schema[path]["POST"].as_strategy())
        def post(case):
            if time.monotonic() > deadline:
                return
            _bounded(case, model)
            resp = case.call_and_validate(base_url=base, checks=validations, timeout=60)
            statuses[resp.status_code] += 1

        post()
    return statuses
