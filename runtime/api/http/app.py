"""OpenAI-compatible HTTP front: a thin FastAPI + uvicorn layer over a `runtime.Client`.

Endpoints: GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
POST /v1/chat/completions (the tokenizer's chat template over the whole message list),
POST /v1/responses (OpenAI's Responses API, stateless, over the chat machinery:
http/responses.py), POST /tokenize, POST /detokenize (vLLM's), GET /version, GET /health,
GET /metrics (the server's Prometheus metrics, relayed: they live in the server process,
runtime/serving/prometheus.py), GET /openapi.json and GET /docs. Streaming answers are
server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. Bad requests are
HTTP 400 with an OpenAI-style error naming the argument.

Two ways to run it:
- inside `tandem serve CONFIG --http HOST:PORT` (a thread of the serving process; see
  `launcher/session.py`), or
- on its own, in front of a running server: `python -m runtime.api.http.app ADDRESS --http
  HOST:PORT`.
With an API key (`--api-key`, TANDEM_API_KEY or server.api_key_file: http/access.py) every
route but /health, /metrics and /version needs `Authorization: Bearer KEY` (http/guard.py),
and it may bind beyond loopback; without one it binds to loopback unless
`--http-allow-remote` is given. `--ssl-keyfile`/`--ssl-certfile` serve HTTPS.

Every HTTP request is one request on the one ZeroMQ client of this front; a request whose HTTP
client goes away (a closed stream, a dropped connection) is cancelled on the server.

This module assembles the app and runs it; the rest of the front: runtime/api/http/routes.py
(the endpoints, a request's life on the server, streaming), openai/requests.py (a request
body as the engine's arguments), openai/structured.py (response_format, structured_outputs
and a chat's tools: the tool-call format and a forced choice's grammar; the calls themselves:
tools/*.py), openai/replies.py (OpenAI's response and chunk shapes),
openai/logprobs.py (their logprobs), openai/tokens.py (token strings, loaded on first need),
openai/errors.py (the error body), openai/bodies.py and openai/reply_models.py (the request
and response bodies' pydantic models, from which validation, the 400s naming `param` and the
schema at /openapi.json come: http/openapi.py), http/tokenizer.py (/tokenize, /detokenize),
http/backend.py (the asyncio-friendly Client), http/access.py (the key and TLS files),
http/guard.py (the key at the door) and http/address.py (listening addresses).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from runtime.api.http.access import (
    REMOTE_NEEDS,
    HttpAccess,
    add_access_flags,
    api_key_given,
    http_access,
)
from runtime.api.http.address import bind_http, connect_address, parse_http_address, socket_url
from runtime.api.http.backend import HttpClient
from runtime.api.http.guard import KeyGuard
from runtime.api.http.openapi import ERRORS, generation, invalid_body, openapi_with
from runtime.api.http.responses import ResponsesRoute
from runtime.api.http.routes import Routes
from runtime.api.http.tokenizer import TokenizerRoutes
from runtime.api.openai.errors import HttpError
from runtime.api.openai.reply_models import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    ModelCard,
    ModelList,
)
from runtime.api.openai.responses_objects import ResponseObject
from runtime.api.tools.parsers import PARSERS
from runtime.version import installed_version

log = logging.getLogger("tandem.http")


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HttpError)  # registered for HttpError only
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def create_app(
    client: HttpClient,
    model_name: str | None = None,
    tokenizer_path: str | None = None,
    tool_parser: str | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The app; `tokenizer_path`: where the server's tokenizer is (token strings of logprobs,
    the chat template's tool-call format; default: the one the server's info() names);
    `tool_parser`: server.tool_parser (None: the chat template's format); `api_key`: the
    bearer key every route but http_guard.OPEN_PATHS needs (None: none needed)."""
    app = FastAPI(
        title="tandem",
        version=installed_version() or "unknown",
        description="OpenAI-compatible API of a tandem server (draft-target speculative "
        "decoding); vLLM's extensions of the request bodies are accepted.",
        redoc_url=None,
        strict_content_type=False,  # a body without a Content-Type is read as JSON
    )
    routes = Routes(client, model_name, tokenizer_path, tool_parser)
    app.add_exception_handler(HttpError, _http_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    if api_key is not None:
        app.add_middleware(KeyGuard, key=api_key)
    tokenizer = TokenizerRoutes(routes)
    app.add_api_route("/tokenize", tokenizer.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", tokenizer.detokenize, methods=["POST"])
    app.add_api_route("/version", routes.version, methods=["GET"])
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
        responses=generation(Completion, CompletionChunk),
    )
    app.add_api_route(
        "/v1/chat/completions",
        routes.chat_completions,
        methods=["POST"],
        response_model=ChatCompletion,
        response_model_exclude_unset=True,
        responses=generation(ChatCompletion, ChatCompletionChunk),
    )
    responses = ResponsesRoute(routes)
    app.add_api_route(
        "/v1/responses",
        responses.create,
        methods=["POST"],
        response_model=ResponseObject,
        responses=ERRORS,
    )
    chunks = (CompletionChunk, ChatCompletionChunk)
    app.openapi = lambda: openapi_with(app, chunks)  # type: ignore[method-assign]
    return app


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
        access: HttpAccess | None = None,
    ):
        """`access`: the API key and TLS files (http_access.http_access checked them)."""
        import uvicorn

        access = access or HttpAccess()
        self.sock = sock
        self.url = socket_url(sock, access.scheme)
        self.client = HttpClient(connect_address(address), auth_key_file=auth_key_file)
        self.app = create_app(
            self.client, model_name, tokenizer_path, tool_parser, api_key=access.api_key
        )
        level = os.environ.get("TANDEM_LOG", "warning").lower()  # as the logging's level
        if level not in ("critical", "error", "warning", "info", "debug"):  # uvicorn's names
            level = "warning"
        config = uvicorn.Config(
            self.app,
            log_level=level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            **access.uvicorn_kwargs(),
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
        prog="python -m runtime.api.http.app",
        description="OpenAI-compatible HTTP API in front of a running `tandem serve`.",
    )
    parser.add_argument("address", help="the server's address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument(
        "--http", default="127.0.0.1:8000", help="HOST:PORT to listen on (default 127.0.0.1:8000)"
    )
    parser.add_argument(
        "--http-allow-remote",
        action="store_true",
        help="allow a non-loopback host without an API key (no authentication)",
    )
    add_access_flags(parser)
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
        "--tool-call-parser",
        "--tool-parser",
        dest="tool_parser",
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
        keyed = api_key_given(args.api_key, None)
        access = http_access(args.api_key, None, args.ssl_keyfile, args.ssl_certfile)
        host, port = parse_http_address(
            args.http, args.http_allow_remote or keyed, remote_needs=REMOTE_NEEDS
        )
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
        args.address,
        sock,
        args.model_name,
        args.auth_key_file,
        tool_parser=args.tool_parser,
        access=access,
    )
    print(f"tandem: HTTP API at {front.url} (server {args.address})", file=sys.stderr, flush=True)
    front.run_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
