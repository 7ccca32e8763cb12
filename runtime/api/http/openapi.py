"""The served OpenAPI schema's parts beyond what FastAPI derives from the routes' pydantic
models: the error answers, the stream chunks of a generating route (server-sent events, no
JSON answer of any route), no 422 (a refused body is OpenAI's 400: `invalid_body`)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from runtime.api.openai.errors import validation_error
from runtime.api.openai.reply_models import ErrorBody


async def invalid_body(_request: Request, exc: Exception) -> JSONResponse:
    """A body its model refused: OpenAI's 400 naming the argument (not FastAPI's 422)."""
    assert isinstance(exc, RequestValidationError)  # registered for it only
    error = validation_error(exc.errors(), getattr(exc, "body", None))
    return JSONResponse(error.body(), status_code=error.status)


ERRORS: dict[int | str, dict] = {
    400: {"model": ErrorBody, "description": "a bad argument (`param` names it)"},
    404: {"model": ErrorBody, "description": "an unknown model"},
    503: {"model": ErrorBody, "description": "the engine is not available"},
}


def generation(model: type, chunk: type) -> dict:
    """The answers of a generating route: `model` (JSON), or with stream: true, server-sent
    events, each an object of SSE fields whose `data` is a `chunk` as JSON text (tandem's
    schema components hold them), or `[DONE]` last."""
    ref = {"$ref": f"#/components/schemas/{chunk.__name__}"}
    event = {
        "type": "object",
        "properties": {
            "event": {"type": "string"},
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},  # the last event
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": ref,
                    },
                ]
            },
        },
        "required": ["data"],
    }
    events = {"text/event-stream": {"schema": event}}
    return {**ERRORS, 200: {"model": model, "content": events}}


def openapi_with(app: FastAPI, extra: tuple[type[BaseModel], ...]) -> dict:
    """The app's OpenAPI schema (made once), its components holding the `extra` models too
    (the stream chunks, which no route returns as JSON), without FastAPI's 422 (a bad body
    is a 400: invalid_body)."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title,
            version=app.version,
            description=app.description,
            routes=app.routes,
        )
        _, defs = models_json_schema(
            [(m, "serialization") for m in extra], ref_template="#/components/schemas/{model}"
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, model_schema in defs.get("$defs", {}).items():
            components.setdefault(name, model_schema)
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for path in schema["paths"].values():
            for operation in path.values():
                operation["responses"].pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema
