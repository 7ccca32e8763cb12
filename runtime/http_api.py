"""OpenAI-compatible HTTP front: a thin FastAPI + uvicorn layer over a `runtime.Client`.

Endpoints: GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
POST /v1/chat/completions (the tokenizer's chat template over the whole message list),
GET /health. Streaming answers are server-sent events in OpenAI's chunk format, ending with
`data: [DONE]`. Bad requests are HTTP 400 with an OpenAI-style error naming the argument.

Two ways to run it:
- inside `tandem serve CONFIG --http HOST:PORT` (a thread of the serving process; see
  `launcher/session.py`), or
- on its own, in front of a running server: `python -m runtime.http_api ADDRESS --http
  HOST:PORT`.
It binds to loopback unless `--http-allow-remote` is given; it has no authentication.

Every HTTP request is one request on the one ZeroMQ client of this front; a request whose HTTP
client goes away (a closed stream, a dropped connection) is cancelled on the server.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from runtime.client import Client
from runtime.errors import EngineDeadError
from runtime.params import SamplingParams

log = logging.getLogger("tandem.http")

DEFAULT_MAX_TOKENS = 16        # OpenAI's default for /v1/completions; used for chat as well
DEFAULT_TEMPERATURE = 1.0      # OpenAI's default (the Python API's default is greedy)
DISCONNECT_POLL_S = 0.5        # how often a waiting non-streamed request checks its client

# Arguments accepted only with their "off" value (anything else is a 400 naming them).
_OFF_VALUES: dict[str, tuple] = {
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "logprobs": (None, False), "top_logprobs": (None, 0),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}), "audio": (None,), "prediction": (None,),
    "modalities": (None, ["text"]), "web_search_options": (None,),
}
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls",
            "reasoning_effort", "prompt_cache_key", "safety_identifier", "verbosity"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
           "stream", "stream_options"}
_COMPLETION_ARGS = _COMMON | {"prompt"} | set(_OFF_VALUES) | _IGNORED
_CHAT_ARGS = _COMMON | {"messages", "max_completion_tokens"} | set(_OFF_VALUES) | _IGNORED


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = \
            status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


# --- addresses ---------------------------------------------------------------------------
def parse_http_address(text: str, allow_remote: bool = False) -> tuple[str, int]:
    """'HOST:PORT', '[V6]:PORT' or 'PORT' (host 127.0.0.1) -> (host, port). A host that is
    not loopback is refused unless allow_remote. Errors are ValueErrors naming --http."""
    text = text.strip()
    match = re.fullmatch(r"(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:\[\]]*)):(?P<port>\d+)", text)
    if match:
        host = match.group("v6") or match.group("host") or "127.0.0.1"
        port = int(match.group("port"))
    elif text.isdigit():
        host, port = "127.0.0.1", int(text)
    else:
        raise ValueError(f"--http: expected HOST:PORT, got {text!r}")
    if not 0 <= port <= 65535:
        raise ValueError(f"--http: port {port} is out of range")
    if not allow_remote and not is_loopback(host):
        raise ValueError(f"--http: {host} is not a loopback address; the HTTP API has no "
                         f"authentication, so binding elsewhere needs --http-allow-remote")
    return host, port


def is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback
                               for info in infos)


def bind_http(host: str, port: int) -> socket.socket:
    """A listening TCP socket (bound before anything else starts, so a taken port is an
    early error and port 0 picks a free one)."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(256)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def connect_address(address: str) -> str:
    """Where a local client reaches a server bound at `address` (a wildcard host becomes
    loopback)."""
    match = re.fullmatch(r"tcp://(\*|0\.0\.0\.0|\[::\]|\[\*\]):(\d+)", address)
    if match:
        host = "[::1]" if match.group(1).startswith("[") else "127.0.0.1"
        return f"tcp://{host}:{match.group(2)}"
    return address


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/v1"


# --- the client side: requests whose replies wake an asyncio loop ------------------------
class _AsyncWaiter:
    """Stands in for the Client's per-request reply queue; the Client's I/O thread puts."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, msg: dict) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, msg)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    async def get(self, timeout: float | None = None) -> dict:
        if timeout is None:
            return await self.queue.get()
        return await asyncio.wait_for(self.queue.get(), timeout)


class HttpClient(Client):
    """A Client whose requests reply into asyncio queues instead of blocking threads."""

    def open_async(self, msg: dict) -> _AsyncWaiter:
        waiter = _AsyncWaiter(asyncio.get_running_loop())
        if self._closed.is_set():
            raise EngineDeadError("client is closed")
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            self._waiters[msg["id"]] = waiter
        self._last_heard = max(self._last_heard, time.monotonic() - 1.0)
        self._outbox.put(msg)
        return waiter

    def finish(self, rid: str, cancel: bool) -> None:
        self._close_waiter(rid)
        if cancel and self._dead is None and not self._closed.is_set():
            self._outbox.put({"type": "cancel", "id": rid})

    def build(self, *, prompt=None, prompt_token_ids=None, messages=None, params: dict,
              stream: bool) -> dict:
        """The generate message (arguments validated here: ValueError names them)."""
        if messages is not None:
            checked = SamplingParams.from_kwargs(**params).to_dict()
            return {"type": "generate", "id": self._new_id(), "params": checked,
                    "stream": stream, "messages": messages}
        msg, _ = self._request(prompt, prompt_token_ids, params, stream, chat=False)
        return msg


# --- request parsing -----------------------------------------------------------------------
def _check_args(body: dict, allowed: set[str]) -> None:
    for name in body:
        if name not in allowed:
            raise HttpError(400, f"Unrecognized request argument supplied: {name}", name)
    for name, off in _OFF_VALUES.items():
        value = body.get(name)
        if value is not None and value not in off:
            raise HttpError(400, f"{name}: {value!r} is not supported by this server", name)
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise HttpError(400, f"n: only n=1 is supported, got {n!r}", "n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise HttpError(400, "stream: expected a boolean", "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not all(
            k in ("include_usage", "include_obfuscation") for k in opts)):
        raise HttpError(400, "stream_options: expected {\"include_usage\": bool}",
                        "stream_options")


def _sampling(body: dict, max_name: str) -> dict:
    max_tokens = body.get(max_name)
    top_k = body.get("top_k")
    if top_k == -1 and not isinstance(top_k, bool):   # vLLM's "off"
        top_k = None
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    kwargs = {"max_new_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
              "temperature": DEFAULT_TEMPERATURE if body.get("temperature") is None
              else body["temperature"],
              "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
              "top_k": top_k, "seed": body.get("seed"), "stop": stop}
    return kwargs


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise HttpError(400, "messages: expected a non-empty list of messages", "messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise HttpError(400, f"messages[{i}]: expected an object with a string 'role'",
                            "messages")
        role = "system" if msg["role"] == "developer" else msg["role"]
        content = msg.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text" and \
                        isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    raise HttpError(400, f"messages[{i}].content: only text parts are "
                                         f"supported", "messages")
            content = "\n".join(parts)
        elif not isinstance(content, str):
            raise HttpError(400, f"messages[{i}].content: expected a string or a list of "
                                 f"text parts", "messages")
        out.append({"role": role, "content": content})
    return out


def _prompt_kwargs(prompt) -> dict:
    def is_int(t):
        return isinstance(t, int) and not isinstance(t, bool)

    if isinstance(prompt, list) and prompt:
        if all(is_int(t) for t in prompt):
            return {"prompt_token_ids": prompt}
        if all(isinstance(row, list) for row in prompt):
            return {"prompt_token_ids": prompt}
    if isinstance(prompt, (str, list)):
        return {"prompt": prompt}
    raise HttpError(400, "prompt: expected a string, a list of strings, a list of token ids "
                         "or a list of such lists", "prompt")


def _value_error(exc: ValueError, max_name: str, prompt_name: str) -> HttpError:
    """A tandem ValueError ('name: ...') as a 400 naming the OpenAI argument."""
    message = str(exc).replace("max_new_tokens", max_name) \
        .replace("prompt_token_ids", prompt_name)
    if prompt_name == "messages":
        message = re.sub(r"^prompt\b", "messages", message)
    match = re.match(r"([A-Za-z_]+)[:\s]", message)
    param = match.group(1) if match else None
    if param and param not in _CHAT_ARGS | _COMPLETION_ARGS:
        param = None
    return HttpError(400, message, param)


def _failure(msg: dict, max_name: str, prompt_name: str) -> HttpError:
    if msg["kind"] == "dead":
        return HttpError(503, f"the engine is not available: {msg['message']}",
                         kind="server_error", code="engine_dead")
    return _value_error(ValueError(msg["message"]), max_name, prompt_name)


def _usage(outputs: list[dict]) -> dict:
    prompt = sum(int(o["stats"].get("prompt_tokens", 0)) for o in outputs)
    completion = sum(len(o["token_ids"]) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _finish(reason: str | None) -> str:
    return reason if reason in ("stop", "length") else "stop"


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


# --- the app -------------------------------------------------------------------------------
def create_app(client: HttpClient, model_name: str | None = None) -> FastAPI:
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None)
    state = {"model": model_name, "created": int(time.time())}

    @app.exception_handler(HttpError)
    async def _http_error(_request, exc: HttpError):
        return JSONResponse(exc.body(), status_code=exc.status)

    async def info() -> dict:
        if client._info is None:
            try:
                await asyncio.to_thread(client.info, 30.0)
            except EngineDeadError as exc:
                raise HttpError(503, f"the engine is not available: {exc}",
                                kind="server_error", code="engine_dead") from None
        return client._info

    async def model_id() -> str:
        if state["model"] is None:
            path = str((await info()).get("model", "tandem"))
            state["model"] = os.path.basename(path.rstrip("/")) or path
        return state["model"]

    async def check_model(body: dict) -> str:
        name = await model_id()
        requested = body.get("model")
        if not isinstance(requested, str) or not requested:
            raise HttpError(400, "model: expected the model's name", "model")
        if requested not in (name, str((await info()).get("model"))):
            raise HttpError(404, f"The model `{requested}` does not exist; this server "
                                 f"serves `{name}`", "model", code="model_not_found")
        return name

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": state["created"],
                "owned_by": "tandem"}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(await model_id())]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        if name != await model_id():
            raise HttpError(404, f"The model `{name}` does not exist", "model",
                            code="model_not_found")
        return model_card(name)

    async def read_body(request: Request) -> dict:
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001 - any undecodable body
            raise HttpError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        return body

    async def submit(request: Request, build_kwargs: dict, stream: bool, max_name: str,
                     prompt_name: str):
        """(message id, waiter, first reply) once the server has answered; a 400/503
        HttpError if it refused the request."""
        await info()  # cached after the first call; token-id validation needs it
        try:
            msg = client.build(stream=stream, **build_kwargs)
            waiter = client.open_async(msg)
        except ValueError as exc:
            raise _value_error(exc, max_name, prompt_name) from None
        except EngineDeadError as exc:
            raise HttpError(503, f"the engine is not available: {exc}",
                            kind="server_error", code="engine_dead") from None
        rid, done = msg["id"], False
        try:
            while True:
                try:
                    reply = await waiter.get(DISCONNECT_POLL_S)
                    break
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise HttpError(499, "client closed the request") from None
            if reply["type"] == "failed":
                done = True
                raise _failure(reply, max_name, prompt_name)
            if reply["type"] == "final":
                done = True
                client.finish(rid, cancel=False)
            return rid, waiter, reply
        except BaseException:
            client.finish(rid, cancel=not done)
            raise

    async def collect(request: Request, rid: str, waiter: _AsyncWaiter, reply: dict,
                      max_name: str, prompt_name: str) -> list[dict]:
        """Wait for the final reply of a non-streamed request (cancelled if the HTTP client
        goes away meanwhile)."""
        done = reply["type"] == "final"
        try:
            while reply["type"] != "final":
                try:
                    reply = await waiter.get(DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise HttpError(499, "client closed the request") from None
                    continue
                if reply["type"] == "failed":
                    done = True
                    raise _failure(reply, max_name, prompt_name)
            done = True
        finally:
            client.finish(rid, cancel=not done)
        return sorted(reply["outputs"], key=lambda o: o["index"])

    def stream_events(rid: str, waiter: _AsyncWaiter, first: dict, chunk, include_usage: bool,
                      max_name: str, prompt_name: str, head: list[bytes]):
        async def events():
            done = first["type"] == "final"
            reply = first
            try:
                for item in head:
                    yield item
                while True:
                    if reply["type"] == "delta":
                        if reply["text"]:
                            yield _sse(chunk(reply["index"], reply["text"], None,
                                             include_usage))
                    elif reply["type"] == "final":
                        done = True
                        outputs = sorted(reply["outputs"], key=lambda o: o["index"])
                        for out in outputs:
                            yield _sse(chunk(out["index"], None,
                                             _finish(out["finish_reason"]), include_usage))
                        if include_usage:
                            last = chunk(0, None, None, include_usage)
                            last["choices"], last["usage"] = [], _usage(outputs)
                            yield _sse(last)
                        yield b"data: [DONE]\n\n"
                        return
                    elif reply["type"] == "failed":
                        done = True
                        yield _sse(_failure(reply, max_name, prompt_name).body())
                        yield b"data: [DONE]\n\n"
                        return
                    reply = await waiter.get()
            finally:
                client.finish(rid, cancel=not done)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        _check_args(body, _COMPLETION_ARGS)
        name = await check_model(body)
        if "prompt" not in body:
            raise HttpError(400, "prompt: this argument is required", "prompt")
        kwargs = dict(_prompt_kwargs(body["prompt"]), params=_sampling(body, "max_tokens"))
        stream = bool(body.get("stream"))
        rid, waiter, first = await submit(request, kwargs, stream, "max_tokens", "prompt")
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if not stream:
            outputs = await collect(request, rid, waiter, first, "max_tokens", "prompt")
            return {"id": cid, "object": "text_completion", "created": created,
                    "model": name, "system_fingerprint": None,
                    "choices": [{"index": o["index"], "text": o["text"], "logprobs": None,
                                 "finish_reason": _finish(o["finish_reason"])}
                                for o in outputs],
                    "usage": _usage(outputs)}

        def chunk(index, text, finish, include_usage):
            out = {"id": cid, "object": "text_completion", "created": created,
                   "model": name, "system_fingerprint": None,
                   "choices": [{"index": index, "text": text or "", "logprobs": None,
                                "finish_reason": finish}]}
            if include_usage:
                out["usage"] = None
            return out

        include = bool((body.get("stream_options") or {}).get("include_usage"))
        return stream_events(rid, waiter, first, chunk, include, "max_tokens", "prompt", [])

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        _check_args(body, _CHAT_ARGS)
        name = await check_model(body)
        max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        kwargs = {"messages": _messages(body.get("messages")),
                  "params": _sampling(body, max_name)}
        stream = bool(body.get("stream"))
        rid, waiter, first = await submit(request, kwargs, stream, max_name, "messages")
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if not stream:
            outputs = await collect(request, rid, waiter, first, max_name, "messages")
            return {"id": cid, "object": "chat.completion", "created": created,
                    "model": name, "system_fingerprint": None,
                    "choices": [{"index": o["index"],
                                 "message": {"role": "assistant", "content": o["text"]},
                                 "logprobs": None,
                                 "finish_reason": _finish(o["finish_reason"])}
                                for o in outputs],
                    "usage": _usage(outputs)}

        def chunk(index, text, finish, include_usage, delta=None):
            if delta is None:
                delta = {} if text is None else {"content": text}
            out = {"id": cid, "object": "chat.completion.chunk", "created": created,
                   "model": name, "system_fingerprint": None,
                   "choices": [{"index": index, "delta": delta, "logprobs": None,
                                "finish_reason": finish}]}
            if include_usage:
                out["usage"] = None
            return out

        include = bool((body.get("stream_options") or {}).get("include_usage"))
        head = [_sse(chunk(0, None, None, include,
                           delta={"role": "assistant", "content": ""}))]
        return stream_events(rid, waiter, first, chunk, include, max_name, "messages", head)

    return app


# --- running it -----------------------------------------------------------------------------
class HttpFront:
    """The app on uvicorn on its own thread (inside `tandem serve`), or in the foreground."""

    def __init__(self, address: str, sock: socket.socket, model_name: str | None = None,
                 auth_key_file: str | None = None):
        import uvicorn

        self.sock = sock
        self.url = socket_url(sock)
        self.client = HttpClient(connect_address(address), auth_key_file=auth_key_file)
        self.app = create_app(self.client, model_name)
        config = uvicorn.Config(self.app, log_level=os.environ.get("TANDEM_HTTP_LOG",
                                                                   "warning").lower(),
                                access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5)
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
        prog="python -m runtime.http_api",
        description="OpenAI-compatible HTTP API in front of a running `tandem serve`.")
    parser.add_argument("address", help="the server's address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--http", default="127.0.0.1:8000", help="HOST:PORT to listen on "
                        "(default 127.0.0.1:8000)")
    parser.add_argument("--http-allow-remote", action="store_true",
                        help="allow a non-loopback host (the API has no authentication)")
    parser.add_argument("--auth-key-file", default=None,
                        help="the server's server.auth_key_file, if it has one")
    parser.add_argument("--model-name", default=None,
                        help="model id to serve (default: the target model's directory name)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("TANDEM_LOG", "WARNING"),
                        format="[tandem] %(levelname)s %(name)s: %(message)s")
    try:
        host, port = parse_http_address(args.http, args.http_allow_remote)
        sock = bind_http(host, port)
    except (ValueError, OSError) as exc:
        print(f"tandem: error: --http: {exc}" if isinstance(exc, OSError) else
              f"tandem: error: {exc}", file=sys.stderr)
        return 2
    front = HttpFront(args.address, sock, args.model_name, args.auth_key_file)
    print(f"tandem: HTTP API at {front.url} (server {args.address})", file=sys.stderr,
          flush=True)
    front.run_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
