"""Request parsing and reply formatting for the OpenAI-compatible HTTP front
(runtime/http_api.py): argument checks that name OpenAI's parameters, HTTP address handling,
and the asyncio-friendly Client the front talks to the server with."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import socket

from runtime.api.client import Client
from runtime.control.protocol import Cancel, ClientReply, Failed, Generate
from runtime.params import SamplingParams

log = logging.getLogger("tandem.http")


DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; used for chat as well
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default (the Python API's default is greedy)
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2] (the Python API takes any finite T >= 0)
DISCONNECT_POLL_S = 0.5  # how often a waiting non-streamed request checks its client

# Arguments accepted only with their "off" value (anything else is a 400 naming them).
_OFF_VALUES: dict[str, tuple] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "prediction": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
}
_IGNORED = {
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "reasoning_effort",
    "prompt_cache_key",
    "safety_identifier",
    "verbosity",
}
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
}
_COMPLETION_ARGS = _COMMON | {"prompt"} | set(_OFF_VALUES) | _IGNORED
_CHAT_ARGS = _COMMON | {"messages", "max_completion_tokens"} | set(_OFF_VALUES) | _IGNORED


class HttpError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status,
            message,
            param,
            kind,
            code,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


# --- addresses ---------------------------------------------------------------------------
def parse_http_address(
    text: str, allow_remote: bool = False, flag: str = "--http", what: str = "the HTTP API"
) -> tuple[str, int]:
    """'HOST:PORT', '[V6]:PORT' or 'PORT' (host 127.0.0.1) -> (host, port). A host that is
    not loopback is refused unless allow_remote. Errors are ValueErrors naming `flag` (the
    option that gave the address; `what` is what it serves)."""
    text = text.strip()
    match = re.fullmatch(r"(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:\[\]]*)):(?P<port>\d+)", text)
    if match:
        host = match.group("v6") or match.group("host") or "127.0.0.1"
        port = int(match.group("port"))
    elif text.isdigit():
        host, port = "127.0.0.1", int(text)
    else:
        raise ValueError(f"{flag}: expected HOST:PORT, got {text!r}")
    if not 0 <= port <= 65535:
        raise ValueError(f"{flag}: port {port} is out of range")
    if not allow_remote and not is_loopback(host):
        raise ValueError(
            f"{flag}: {host} is not a loopback address; {what} has no "
            f"authentication, so binding elsewhere needs {flag}-allow-remote"
        )
    return host, port


def is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(
        ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos
    )


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
        self.queue: asyncio.Queue[ClientReply] = asyncio.Queue()

    def put(self, msg: ClientReply) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, msg)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    async def get(self, timeout: float | None = None) -> ClientReply:
        if timeout is None:
            return await self.queue.get()
        return await asyncio.wait_for(self.queue.get(), timeout)


class HttpClient(Client):
    """A Client whose requests reply into asyncio queues instead of blocking threads."""

    def open_async(self, msg: Generate) -> _AsyncWaiter:
        return self._open(msg, _AsyncWaiter(asyncio.get_running_loop()))

    def finish(self, rid: str, cancel: bool) -> None:
        self._close_waiter(rid)
        if cancel and self._dead is None and not self._closed.is_set():
            self._post(Cancel(rid))

    def build(
        self, *, prompt=None, prompt_token_ids=None, messages=None, params: dict, stream: bool
    ) -> Generate:
        """The generate message (arguments validated here: ValueError names them)."""
        if messages is not None:
            checked = SamplingParams.from_kwargs(**params).to_dict()
            return Generate(self._new_id(), checked, stream, messages=messages)
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
    if opts is not None and (
        not isinstance(opts, dict)
        or not all(k in ("include_usage", "include_obfuscation") for k in opts)
    ):
        raise HttpError(400, 'stream_options: expected {"include_usage": bool}', "stream_options")


def _sampling(body: dict, max_name: str) -> dict:
    max_tokens = body.get(max_name)
    top_k = body.get("top_k")
    if top_k == -1 and not isinstance(top_k, bool):  # vLLM's "off"
        top_k = None
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    temperature = body.get("temperature")
    if temperature is None:
        temperature = DEFAULT_TEMPERATURE
    elif _is_number(temperature) and not 0 <= temperature <= MAX_TEMPERATURE:
        raise HttpError(
            400,
            f"temperature: expected a number in [0, {MAX_TEMPERATURE:g}], got {temperature!r}",
            "temperature",
        )
    kwargs = {
        "max_new_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        "temperature": temperature,
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
        "top_k": top_k,
        "seed": body.get("seed"),
        "stop": stop,
    }
    return kwargs


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise HttpError(400, "messages: expected a non-empty list of messages", "messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise HttpError(
                400, f"messages[{i}]: expected an object with a string 'role'", "messages"
            )
        role = "system" if msg["role"] == "developer" else msg["role"]
        content = msg.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for part in content:
                if (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    parts.append(part["text"])
                else:
                    raise HttpError(
                        400, f"messages[{i}].content: only text parts are supported", "messages"
                    )
            content = "\n".join(parts)
        elif not isinstance(content, str):
            raise HttpError(
                400, f"messages[{i}].content: expected a string or a list of text parts", "messages"
            )
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
    raise HttpError(
        400,
        "prompt: expected a string, a list of strings, a list of token ids or a list of such lists",
        "prompt",
    )


def _value_error(exc: ValueError, max_name: str, prompt_name: str) -> HttpError:
    """A tandem ValueError ('name: ...') as a 400 naming the OpenAI argument."""
    message = str(exc).replace("max_new_tokens", max_name).replace("prompt_token_ids", prompt_name)
    if prompt_name == "messages":
        message = re.sub(r"^prompt\b", "messages", message)
    match = re.match(r"([A-Za-z_]+)[:\s]", message)
    param = match.group(1) if match else None
    if param and param not in _CHAT_ARGS | _COMPLETION_ARGS:
        param = None
    return HttpError(400, message, param)


def _failure(msg: Failed, max_name: str, prompt_name: str) -> HttpError:
    if msg.kind == "dead":
        return HttpError(
            503,
            f"the engine is not available: {msg.message}",
            kind="server_error",
            code="engine_dead",
        )
    if msg.kind == "cancelled":
        return HttpError(
            503,
            f"the request was cancelled: {msg.message}",
            kind="server_error",
            code="request_cancelled",
        )
    return _value_error(ValueError(msg.message), max_name, prompt_name)


def _usage(outputs: list[dict]) -> dict:
    prompt = sum(int(o["stats"].get("prompt_tokens", 0)) for o in outputs)
    completion = sum(len(o["token_ids"]) for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _finish(reason: str | None) -> str:
    return reason if reason in ("stop", "length") else "stop"


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


# --- the app -------------------------------------------------------------------------------
