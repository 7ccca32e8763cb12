"""The typed HTTP front without a server: the OpenAPI schema that GET /openapi.json serves and
GET /docs shows (runtime.api.http.app), made from the bodies' pydantic models
(runtime.api.openai.bodies, openai_replies), and the 400s their refusals become
(runtime.api.openai.errors.validation_error): OpenAI's error naming the argument, never
FastAPI's 422."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from runtime.api.http.app import create_app
from runtime.api.openai.bodies import ChatCompletionRequest, CompletionRequest
from runtime.api.openai.errors import HttpError, validation_error
from tests.http_bodies import validated

pytestmark = pytest.mark.timeout(60)

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http():
    # no engine: these requests are refused (or served) before any is needed
    with TestClient(create_app(None, "tiny")) as client:  # type: ignore[arg-type]
        yield client


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_openapi_json_describes_the_routes_and_their_bodies(http):
    resp = http.get("/openapi.json")
    assert resp.status_code == 200
    schema = resp.json()
    assert schema["info"]["title"] == "tandem" and schema["info"]["version"]
    paths, components = schema["paths"], schema["components"]["schemas"]
    assert {"/v1/models", "/v1/models/{name}", "/v1/completions", "/v1/chat/completions"} <= set(
        paths
    )
    for path, body in (
        ("/v1/completions", "Completion"),
        ("/v1/chat/completions", "ChatCompletion"),
    ):
        post = paths[path]["post"]
        request = post["requestBody"]["content"]["application/json"]["schema"]
        assert request == {"$ref": f"#/components/schemas/{body}Request"}
        assert set(post["responses"]) == {"200", "400", "404", "503"}  # no 422
        answers = post["responses"]["200"]["content"]
        assert answers["application/json"]["schema"]["$ref"].endswith(f"/{body}")
        event = answers["text/event-stream"]["schema"]  # SSE fields; data: a chunk, or [DONE]
        done, chunk = event["properties"]["data"]["anyOf"]
        assert done == {"const": "[DONE]"} and chunk["contentMediaType"] == "application/json"
        assert chunk["contentSchema"]["$ref"].endswith(f"/{body}Chunk")
    ok = paths["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]
    assert ok["schema"]["$ref"].endswith("/ModelList")
    for ref in _refs(schema):  # every reference resolves
        assert ref.removeprefix("#/components/schemas/") in components, ref


def test_each_argument_is_defined_once_with_its_bounds(http):
    components = http.get("/openapi.json").json()["components"]["schemas"]
    completion, chat = components["CompletionRequest"], components["ChatCompletionRequest"]
    assert completion["additionalProperties"] is False  # unknown arguments are refused
    assert set(completion["required"]) == {"model", "prompt"}
    assert set(chat["required"]) == {"model", "messages"}
    props = completion["properties"]
    temperature = props["temperature"]
    assert temperature["default"] == 1.0 and temperature["description"]
    assert {"type": "number", "minimum": 0, "maximum": 2.0} == temperature["anyOf"][0]
    assert props["top_p"]["anyOf"][0]["exclusiveMinimum"] == 0
    assert props["logprobs"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 20}
    assert (props["best_of"]["type"], props["best_of"]["enum"]) == ("integer", [1])
    for vllm in ("top_k", "min_p", "repetition_penalty", "min_tokens", "structured_outputs"):
        assert vllm in props and vllm in chat["properties"], vllm
    assert chat["properties"]["messages"]["minItems"] == 1
    assert chat["properties"]["logprobs"]["anyOf"][0] == {"type": "boolean"}
    assert "echo" not in chat["required"] and "suffix" not in chat["properties"]


def test_docs_page_shows_the_schema(http):
    resp = http.get("/docs")
    assert resp.status_code == 200 and "/openapi.json" in resp.text
    assert "swagger" in resp.text.lower()


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("completions", {"prompt": "x", "temperature": "hot"}, "temperature", "in [0, 2]"),
        ("completions", {"prompt": "x", "temperature": True}, "temperature", "got True"),
        ("completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "logit_bias.5: "),
        ("completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "not a token id"),
        (
            "completions",
            {"prompt": "x", "bogus": 1},
            "bogus",
            "Unrecognized request argument supplied: bogus",
        ),
        ("completions", {}, "prompt", "prompt: this argument is required"),
        ("completions", {"prompt": {"a": 1}}, "prompt", "a list of token ids"),
        ("completions", {"prompt": "x", "n": True}, "n", "n: expected an integer >= 1, got True"),
        ("completions", {"prompt": "x", "max_tokens": "4"}, "max_tokens", "integer"),
        ("completions", {"prompt": "x", "stop": [1]}, "stop", "a string or a list of strings"),
        ("completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", "token ids"),
        (
            "completions",
            {"prompt": "x", "stream_options": {"bogus": True}},
            "stream_options",
            "stream_options: unknown field 'bogus'",
        ),
        ("completions", {"prompt": "x", "stream": "yes"}, "stream", "true or false"),
        ("completions", {"prompt": "x", "top_logprobs": 1}, "top_logprobs", "Unrecognized"),
        ("chat/completions", {}, "messages", "messages: this argument is required"),
        ("chat/completions", {"messages": USER, "logprobs": 1}, "logprobs", "true or false"),
        ("chat/completions", {"messages": USER, "top_logprobs": 1.5}, "top_logprobs", "1.5"),
        ("chat/completions", {"messages": USER, "echo": True}, "echo", "not supported"),
        ("chat/completions", {"messages": USER, "modalities": ["audio"]}, "modalities", "audio"),
        ("chat/completions", {"messages": USER, "user": 5}, "user", "user: "),
    ],
)
def test_a_refused_body_is_openais_400_naming_the_argument(http, path, body, param, words):
    resp = http.post(f"/v1/{path}", json={"model": "tiny", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["code"] is None and words in error["message"], error


def test_the_model_argument_is_required_and_a_string(http):
    for body in ({"prompt": "x"}, {"prompt": "x", "model": 5}, {"prompt": "x", "model": ""}):
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "model", resp.text


def test_a_body_that_is_not_a_json_object(http):
    headers = {"Content-Type": "application/json"}
    resp = http.post("/v1/completions", content=b"{not json", headers=headers)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] is None and "not valid JSON" in error["message"]
    resp = http.post("/v1/chat/completions", json=[1, 2])
    assert resp.status_code == 400, resp.text
    assert "must be a JSON object" in resp.json()["error"]["message"]
    body = b'{"model": "tiny", "prompt": "x", "temperature": 9}'
    resp = http.post("/v1/completions", content=body)  # no Content-Type: read as JSON
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature"
    resp = http.post("/v1/completions", content=body, headers={"Content-Type": "text/plain"})
    assert resp.status_code == 400, resp.text
    assert "Content-Type: application/json" in resp.json()["error"]["message"]


def test_a_null_is_the_arguments_default():
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "temperature": None, "n": None, "echo": None}
    )
    assert (body.temperature, body.n, body.echo, body.max_tokens) == (1.0, 1, False, 16)
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "stop": None})
    assert chat.stop is None and chat.top_p == 1.0


def test_a_nested_location_is_said_and_the_top_level_argument_named():
    error = validation_error(
        [
            {
                "type": "string_type",
                "loc": ("body", "messages", 0, "content"),
                "msg": "Input should be a valid string",
                "input": 5,
            }
        ]
    )
    assert error.status == 400 and error.param == "messages"
    assert error.message == "messages[0].content: Input should be a valid string, got 5"


def test_integers_are_json_schemas_and_fit_the_wire():
    """2.0 is an integer (JSON Schema's), made one; an integer past 2**63 is refused, as the
    engine's wire (msgpack) could not carry it."""
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": [1.0, 2], "n": 2.0, "stop_token_ids": [3.0]}
    )
    assert (body.prompt, body.n, body.stop_token_ids) == ([1, 2], 2, [3])
    assert all(type(v) is int for v in (*body.prompt, body.n, *body.stop_token_ids))
    for bad in ({"seed": 2**63}, {"n": 2.5}, {"stop_token_ids": [2**64]}, {"prompt": [2**63]}):
        with pytest.raises(HttpError) as caught:
            validated(CompletionRequest, {"model": "m", "prompt": "x", **bad})
        assert caught.value.param == next(iter(bad)), caught.value.body()
