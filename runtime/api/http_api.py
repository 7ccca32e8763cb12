"""OpenAI-compatible HTTP front: a thin FastAPI + uvicorn layer over a `runtime.Client`.

Endpoints: GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
POST /v1/chat/completions (the tokenizer's chat template over the whole message list),
GET /health, GET /metrics (the server's Prometheus metrics, relayed: they live in the server
process, runtime/serving/prometheus.py). Streaming answers are server-sent events in OpenAI's
chunk format, ending with `data: [DONE]`. Bad requests are HTTP 400 with an OpenAI-style
error naming the argument. The API is typed: each request and response body is a pydantic
model (openai_bodies.py, openai_replies.py), from which FastAPI validates the bodies, a
refused body's 400 names the argument (openai_errors.validation_error: never FastAPI's 422)
and the schema served at GET /openapi.json (browsable at GET /docs) comes.

Two ways to run it:
- inside `tandem serve CONFIG --http HOST:PORT` (a thread of the serving process; see
  `launcher/session.py`), or
- on its own, in front of a running server: `python -m runtime.api.http_api ADDRESS --http
  HOST:PORT`.
It binds to loopback unless `--http-allow-remote` is given; it has no authentication.

Every HTTP request is one request on the one ZeroMQ client of this front; a request whose HTTP
client goes away (a closed stream, a dropped connection) is cancelled on the server.

This module assembles the app and runs it; the rest of the front: runtime/api/http_routes.py
(the endpoints, a request's life on the server, streaming), openai_bodies.py (the request
bodies' models; their field types: openai_fields.py, openai_schemas.py), openai_replies.py
(the response bodies'), openai_requests.py (a request body as the engine's arguments),
openai_structured.py (response_format, structured_outputs and a chat's tools: the tool-call
format and a forced choice's grammar; the calls themselves: tool_calls*.py),
openai_responses.py (OpenAI's response and chunk shapes), openai_logprobs.py (their
logprobs), openai_tokens.py (token strings, loaded on first need), openai_errors.py (the
error body), http_client.py (the asyncio-friendly Client) and
http_address.py (listening addresses).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from runtime.api.http_address import bind_http, connect_address, parse_http_address, socket_url
from runtime.api.http_client import HttpClient
from runtime.api.http_routes import Routes
from runtime.api.openai_errors import HttpError, validation_error
from runtime.api.openai_replies import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    ErrorBody,
    ModelCard,
    ModelList,
)
from runtime.api.tool_calls import PARSERS

log = logging.getLogger("tandem.http")


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HttpError)  # registered for HttpError only
    return JSONResponse(exc.body(), status_code=exc.status)


async def _invalid_body(_request: Request, exc: Exception) -> JSONResponse:
    """A body its model refused: OpenAI's 400 naming the argument (not FastAPI's 422)."""
    assert isinstance(exc, RequestValidationError)  # registered for it only
    error = validation_error(exc.errors())
    return JSONResponse(error.body(), status_code=error.status)


def _version() -> str:
    try:
        return version("tandem")
    except PackageNotFoundError:  # a checkout that was never installed
        return "unknown"


ERRORS: dict[int | str, dict] = {
    400: {"model": ErrorBody, "description": "a bad argument (`param` names it)"},
    404: {"model": ErrorBody, "description": "an unknown model"},
    503: {"model": ErrorBody, "description": "the engine is not available"},
}


def _generation(model: type, chunk: type) -> dict:
    """The answers of a generating route: `model` (JSON), or with stream: true, server-sent
    events whose data are `chunk`s (tandem's schema components hold them)."""
    ref = {"$ref": f"#/components/schemas/{chunk.__name__}"}
    events = {"text/event-stream": {"schema": ref}}
    return {**ERRORS, 200: {"model": model, "content": events}}


def create_app(
    client: HttpClient,
    model_name: str | None = None,
    tokenizer_path: str | None = None,
    tool_parser: str | None = None,
) -> FastAPI:
    """The app; `tokenizer_path`: where the server's tokenizer is (token strings of logprobs,
    the chat template's tool-call format; default: the one the server's info() names);
    `tool_parser`: server.tool_parser (None: the chat template's format)."""
    app = FastAPI(
        title="tandem",
        version=_version(),
        description="OpenAI-compatible API of a tandem server (draft-target speculative "
        "decoding); vLLM's extensions of the request bodies are accepted.",
        redoc_url=None,
        strict_content_type=False,  # a body without a Content-Type is read as JSON
    )
    routes = Routes(client, model_name, tokenizer_path, tool_parser)
    app.add_exception_handler(HttpError, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    app.add_api_route(
        "/v1/models", routes.models, methods=["GET"], response_model=ModelList, responses=ERRORS
    )
    app.add_api_route(
        "/v1/models/{name:path}",
        routes.one_model,
        methods=["GET"],
        response_model=ModelCard,
        responses=ERRORS,
    )
    app.add_api_route(
        "/v1/completions",
        routes.completions,
        methods=["POST"],
        response_model=Completion,
        response_model_exclude_unset=True,
        responses=_generation(Completion, CompletionChunk),
    )
    app.add_api_route(
        "/v1/chat/completions",
        routes.chat_completions,
        methods=["POST"],
        response_model=ChatCompletion,
        response_model_exclude_unset=True,
        responses=_generation(ChatCompletion, ChatCompletionChunk),
    )
    chunks = (CompletionChunk, ChatCompletionChunk)
    app.openapi = lambda: openapi_with(app, chunks)  # type: ignore[method-assign]
    return app


def openapi_with(app: FastAPI, extra: tuple[type[BaseModel], ...]) -> dict:
    """The app's OpenAPI schema (made once), its components holding the `extra` models too
    (the stream chunks, which no route returns as JSON), without FastAPI's 422 (a bad body
    is a 400: _invalid_body)."""
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


# --- running it -----------------------------------------------------------------------------
class HttpFront:
    """The app on uvicorn on its own thread (inside `tandem serve`), or in the foreground."""

    def __init__(
        self,
        address: str,
        sock: socket.socket,
        model_name: str | None = None,
        auth_key_file: str | None = None,
        tokenizer_path: str | None = None,
        tool_parser: str | None = None,
    ):
        import uvicorn

        self.sock = sock
        self.url = socket_url(sock)
        self.client = HttpClient(connect_address(address), auth_key_file=auth_key_file)
        self.app = create_app(self.client, model_name, tokenizer_path, tool_parser)
        level = os.environ.get("TANDEM_LOG", "warning").lower()  # as the logging's level
        if level not in ("critical", "error", "warning", "info", "debug"):  # uvicorn's names
            level = "warning"
        config = uvicorn.Config(
            self.app, log_level=level, access_log=False, lifespan="off", timeout_graceful_shutdown=5
        )
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as exc:  # noqa: BLE001 - reported by start()/the log
            self.error = exc
            log.error("HTTP front stopped: %s", exc)

    def start(self, timeout_s: float = 30.0) -> None:
        """Serve on a thread; returns once uvicorn accepts connections."""
        self._thread = threading.Thread(target=self._run, name="tandem-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP front did not start: {self.error}")
            time.sleep(0.02)

    def run_forever(self) -> None:
        """Serve until SIGINT/SIGTERM (then stop and return: exit code 0)."""
        import signal

        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        self.start()
        try:
            while not stop.wait(0.2):
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError(f"the HTTP front stopped: {self.error}")
        finally:
            self.stop()

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.client.close()
        self.sock.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.api.http_api",
        description="OpenAI-compatible HTTP API in front of a running `tandem serve`.",
    )
    parser.add_argument("address", help="the server's address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument(
        "--http", default="127.0.0.1:8000", help="HOST:PORT to listen on (default 127.0.0.1:8000)"
    )
    parser.add_argument(
        "--http-allow-remote",
        action="store_true",
        help="allow a non-loopback host (the API has no authentication)",
    )
    parser.add_argument(
        "--auth-key-file", default=None, help="the server's server.auth_key_file, if it has one"
    )
    parser.add_argument(
        "--served-model-name",
        "--model-name",
        dest="model_name",
        default=None,
        metavar="NAME",
        help="the model id clients name (default: the target model's file or directory name)",
    )
    parser.add_argument(
        "--tool-parser",
        choices=PARSERS,
        default=None,
        help="the tool-call format of chat outputs (server.tool_parser; default: the one "
        "the chat template shows)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("TANDEM_LOG", "WARNING"),
        format="[tandem] %(levelname)s %(name)s: %(message)s",
    )
    try:
        host, port = parse_http_address(args.http, args.http_allow_remote)
        sock = bind_http(host, port)
    except (ValueError, OSError) as exc:
        print(
            f"tandem: error: --http: {exc}"
            if isinstance(exc, OSError)
            else f"tandem: error: {exc}",
            file=sys.stderr,
        )
        return 2
    front = HttpFront(
        args.address, sock, args.model_name, args.auth_key_file, tool_parser=args.tool_parser
    )
    print(f"tandem: HTTP API at {front.url} (server {args.address})", file=sys.stderr, flush=True)
    front.run_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
