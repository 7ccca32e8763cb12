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
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from runtime.api.http_args import (
    _CHAT_ARGS,
    _COMPLETION_ARGS,
    DISCONNECT_POLL_S,
    HttpClient,
    HttpError,
    _AsyncWaiter,
    _check_args,
    _failure,
    _finish,
    _messages,
    _prompt_kwargs,
    _sampling,
    _sse,
    _usage,
    _value_error,
    bind_http,
    connect_address,
    parse_http_address,
    socket_url,
)
from runtime.control.protocol import ClientReply, Delta, Failed, Final
from runtime.errors import EngineDeadError

log = logging.getLogger("tandem.http")


class _Routes:
    """The endpoints over one HttpClient; create_app registers them on a FastAPI app."""

    def __init__(self, client: HttpClient, model_name: str | None):
        self.client = client
        # the served model id: `--served-model-name`, else (found on the first request) the
        # target's file or directory name, when its full path is accepted too
        self.model = model_name
        self.named = model_name is not None
        self.created = int(time.time())

    async def info(self) -> dict:
        info = self.client._info  # cached after the first answer
        if info is None:
            try:
                info = await asyncio.to_thread(self.client.info, 30.0)
            except EngineDeadError as exc:
                raise HttpError(
                    503,
                    f"the engine is not available: {exc}",
                    kind="server_error",
                    code="engine_dead",
                ) from None
        return info

    async def model_id(self) -> str:
        if self.model is None:
            path = str((await self.info()).get("model", "tandem"))
            self.model = os.path.basename(path.rstrip("/")) or path
        return self.model

    async def check_model(self, body: dict) -> str:
        name = await self.model_id()
        requested = body.get("model")
        if not isinstance(requested, str) or not requested:
            raise HttpError(400, "model: expected the model's name", "model")
        accepted = {name} if self.named else {name, str((await self.info()).get("model"))}
        if requested not in accepted:
            raise self.not_found(requested, name)
        return name

    @staticmethod
    def not_found(requested: str, name: str) -> HttpError:
        return HttpError(
            404,
            f"The model `{requested}` does not exist; this server serves `{name}`",
            "model",
            code="model_not_found",
        )

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "tandem"}

    async def health(self):
        return {"status": "ok"}

    async def metrics(self):
        """The server's exposition (prometheus_client.generate_latest: the 0.0.4 text
        format) with its content type."""
        try:
            text = await asyncio.to_thread(self.client.metrics, 30.0)
        except EngineDeadError as exc:
            raise HttpError(
                503, f"the engine is not available: {exc}", kind="server_error", code="engine_dead"
            ) from None
        return Response(text, media_type=CONTENT_TYPE_PLAIN_0_0_4)

    async def models(self):
        return {"object": "list", "data": [self.model_card(await self.model_id())]}

    async def one_model(self, name: str):
        served = await self.model_id()
        if name != served:
            raise self.not_found(name, served)
        return self.model_card(name)

    async def read_body(self, request: Request) -> dict:
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001 - any undecodable body
            raise HttpError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        return body

    async def submit(
        self, request: Request, build_kwargs: dict, stream: bool, max_name: str, prompt_name: str
    ):
        """(message id, waiter, first reply) once the server has answered; a 400/503
        HttpError if it refused the request."""
        await self.info()  # cached after the first call; token-id validation needs it
        try:
            msg = self.client.build(stream=stream, **build_kwargs)
            waiter = self.client.open_async(msg)
        except ValueError as exc:
            raise _value_error(exc, max_name, prompt_name) from None
        except EngineDeadError as exc:
            raise HttpError(
                503, f"the engine is not available: {exc}", kind="server_error", code="engine_dead"
            ) from None
        rid, done = msg.id, False
        try:
            while True:
                try:
                    reply = await waiter.get(DISCONNECT_POLL_S)
                    break
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise HttpError(499, "client closed the request") from None
            if isinstance(reply, Failed):
                done = True
                raise _failure(reply, max_name, prompt_name)
            if isinstance(reply, Final):
                done = True
                self.client.finish(rid, cancel=False)
            return rid, waiter, reply
        except BaseException:
            self.client.finish(rid, cancel=not done)
            raise

    async def collect(
        self,
        request: Request,
        rid: str,
        waiter: _AsyncWaiter,
        reply: ClientReply,
        max_name: str,
        prompt_name: str,
    ) -> list[dict]:
        """Wait for the final reply of a non-streamed request (cancelled if the HTTP client
        goes away meanwhile)."""
        done = isinstance(reply, Final)
        try:
            while not isinstance(reply, Final):
                try:
                    reply = await waiter.get(DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise HttpError(499, "client closed the request") from None
                    continue
                if isinstance(reply, Failed):
                    done = True
                    raise _failure(reply, max_name, prompt_name)
            done = True
        finally:
            self.client.finish(rid, cancel=not done)
        return sorted(reply.outputs, key=lambda o: o["index"])

    def stream_events(
        self,
        rid: str,
        waiter: _AsyncWaiter,
        first: ClientReply,
        chunk,
        include_usage: bool,
        max_name: str,
        prompt_name: str,
        head: list[bytes],
    ):
        async def events():
            done = isinstance(first, Final)
            reply = first
            try:
                for item in head:
                    yield item
                while True:
                    if isinstance(reply, Delta):
                        if reply.text:
                            yield _sse(chunk(reply.index, reply.text, None, include_usage))
                    elif isinstance(reply, Final):
                        done = True
                        outputs = sorted(reply.outputs, key=lambda o: o["index"])
                        for out in outputs:
                            yield _sse(
                                chunk(
                                    out["index"], None, _finish(out["finish_reason"]), include_usage
                                )
                            )
                        if include_usage:
                            last = chunk(0, None, None, include_usage)
                            last["choices"], last["usage"] = [], _usage(outputs)
                            yield _sse(last)
                        yield b"data: [DONE]\n\n"
                        return
                    elif isinstance(reply, Failed):
                        done = True
                        yield _sse(_failure(reply, max_name, prompt_name).body())
                        yield b"data: [DONE]\n\n"
                        return
                    reply = await waiter.get()
            finally:
                self.client.finish(rid, cancel=not done)

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def completions(self, request: Request):
        body = await self.read_body(request)
        _check_args(body, _COMPLETION_ARGS)
        name = await self.check_model(body)
        if "prompt" not in body:
            raise HttpError(400, "prompt: this argument is required", "prompt")
        kwargs = dict(_prompt_kwargs(body["prompt"]), params=_sampling(body, "max_tokens"))
        stream = bool(body.get("stream"))
        rid, waiter, first = await self.submit(request, kwargs, stream, "max_tokens", "prompt")
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if not stream:
            outputs = await self.collect(request, rid, waiter, first, "max_tokens", "prompt")
            return {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": name,
                "system_fingerprint": None,
                "choices": [
                    {
                        "index": o["index"],
                        "text": o["text"],
                        "logprobs": None,
                        "finish_reason": _finish(o["finish_reason"]),
                    }
                    for o in outputs
                ],
                "usage": _usage(outputs),
            }

        def chunk(index, text, finish, include_usage):
            out = {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": name,
                "system_fingerprint": None,
                "choices": [
                    {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
                ],
            }
            if include_usage:
                out["usage"] = None
            return out

        include = bool((body.get("stream_options") or {}).get("include_usage"))
        return self.stream_events(rid, waiter, first, chunk, include, "max_tokens", "prompt", [])

    async def chat_completions(self, request: Request):
        body = await self.read_body(request)
        _check_args(body, _CHAT_ARGS)
        name = await self.check_model(body)
        max_name = (
            "max_completion_tokens"
            if body.get("max_completion_tokens") is not None
            else "max_tokens"
        )
        kwargs = {"messages": _messages(body.get("messages")), "params": _sampling(body, max_name)}
        stream = bool(body.get("stream"))
        rid, waiter, first = await self.submit(request, kwargs, stream, max_name, "messages")
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if not stream:
            outputs = await self.collect(request, rid, waiter, first, max_name, "messages")
            return {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": name,
                "system_fingerprint": None,
                "choices": [
                    {
                        "index": o["index"],
                        "message": {"role": "assistant", "content": o["text"]},
                        "logprobs": None,
                        "finish_reason": _finish(o["finish_reason"]),
                    }
                    for o in outputs
                ],
                "usage": _usage(outputs),
            }

        def chunk(index, text, finish, include_usage, delta=None):
            if delta is None:
                delta = {} if text is None else {"content": text}
            out = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": name,
                "system_fingerprint": None,
                "choices": [
                    {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }
            if include_usage:
                out["usage"] = None
            return out

        include = bool((body.get("stream_options") or {}).get("include_usage"))
        head = [_sse(chunk(0, None, None, include, delta={"role": "assistant", "content": ""}))]
        return self.stream_events(rid, waiter, first, chunk, include, max_name, "messages", head)


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HttpError)  # registered for HttpError only
    return JSONResponse(exc.body(), status_code=exc.status)


def create_app(client: HttpClient, model_name: str | None = None) -> FastAPI:
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None)
    routes = _Routes(client, model_name)
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
    ):
        import uvicorn

        self.sock = sock
        self.url = socket_url(sock)
        self.client = HttpClient(connect_address(address), auth_key_file=auth_key_file)
        self.app = create_app(self.client, model_name)
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


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
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
    front = HttpFront(args.address, sock, args.model_name, args.auth_key_file)
    print(f"tandem: HTTP API at {front.url} (server {args.address})", file=sys.stderr, flush=True)
    front.run_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
