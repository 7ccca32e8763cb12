"""OpenAI-compatible HTTP front: a thin FastAPI + uvicorn layer over a `runtime.Client`.

Endpoints: GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
POST /v1/chat/completions (the tokenizer's chat template over the whole message list),
GET /health, GET /metrics (the server's Prometheus metrics, relayed: they live in the server
process, runtime/serving/prometheus.py). Streaming answers are server-sent events in OpenAI's
chunk format, ending with `data: [DONE]`. Bad requests are HTTP 400 with an OpenAI-style
error naming the argument.

Two ways to run it:
- inside `tandem serve CONFIG --http HOST:PORT` (a thread of the serving process; see
  `launcher/session.py`), or
- on its own, in front of a running server: `python -m runtime.api.http_api ADDRESS --http
  HOST:PORT`.
It binds to loopback unless `--http-allow-remote` is given; it has no authentication.

Every HTTP request is one request on the one ZeroMQ client of this front; a request whose HTTP
client goes away (a closed stream, a dropped connection) is cancelled on the server.

This module assembles the app and runs it; the rest of the front: runtime/api/http_routes.py
(the endpoints, a request's life on the server, streaming), openai_requests.py (a request
body as the engine's arguments), openai_structured.py (response_format, structured_outputs
and a chat's tools: the tool-call format and a forced choice's grammar; the calls themselves:
tool_calls*.py), openai_responses.py (OpenAI's response and chunk shapes),
openai_logprobs.py (their logprobs), openai_tokens.py (token strings, loaded on first need),
openai_errors.py (the error body), http_client.py (the asyncio-friendly Client) and
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

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from runtime.api.http_address import bind_http, connect_address, parse_http_address, socket_url
from runtime.api.http_client import HttpClient
from runtime.api.http_routes import Routes
from runtime.api.openai_errors import HttpError
from runtime.api.tool_calls import PARSERS

log = logging.getLogger("tandem.http")


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HttpError)  # registered for HttpError only
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def create_app(
    client: HttpClient,
    model_name: str | None = None,
    tokenizer_path: str | None = None,
    tool_parser: str | None = None,
) -> FastAPI:
    """The app; `tokenizer_path`: where the server's tokenizer is (token strings of logprobs,
    the chat template's tool-call format; default: the one the server's info() names);
    `tool_parser`: server.tool_parser (None: the chat template's format)."""
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None)
    routes = Routes(client, model_name, tokenizer_path, tool_parser)
    app.add_exception_handler(HttpError, _http_error)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/models/{name:path}", routes.one_model, methods=["GET"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
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
