"""Errors the public API raises."""

from collections.abc import Iterator
from contextlib import contextmanager


class EngineDeadError(RuntimeError):
    """The engine (a worker, the orchestrator or the server) is gone or unreachable."""


class EngineClosedError(EngineDeadError):
    """The Client or Engine was closed: every call still waiting when close() was called
    raises it, and so does every call after. An EngineDeadError, so that code that handles
    a dead engine handles a closed one too."""


class EngineDrainingError(EngineDeadError):
    """The server is shutting down (draining after SIGTERM): it refused this new request
    while it finishes the ones in flight. An EngineDeadError, as the server is about to be
    gone: send the request again to another server, or to this one once restarted."""


class RequestCancelledError(RuntimeError):
    """The server ended a request before its result: it heard nothing from this client for
    longer than its client timeout (a client that stopped pinging), or the client cancelled
    it. The engine keeps serving; the request may be sent again."""


class RequestError(ValueError):
    """The server refused a request (bad arguments); the engine keeps serving."""


class ConfigError(ValueError):
    """A config problem; `str(e)` starts with the dotted key (`e.key`) at fault."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


class ArgumentError(ValueError):
    """A bad request argument: `param` is its name (the engine's: max_new_tokens,
    prompt_token_ids, logit_bias, ...); `str(e)` says what is wrong, starting with the
    argument or the place in it ("logit_bias[5]: ..."). The server's refusal carries `param`
    across the wire (runtime.control.protocol.Failed), so the HTTP front names OpenAI's
    argument without reading the message."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@contextmanager
def naming(param: str) -> Iterator[None]:
    """A ValueError raised inside (by a check that names no argument) is an ArgumentError
    naming `param`."""
    try:
        yield
    except ArgumentError:
        raise
    except ValueError as exc:
        raise ArgumentError(str(exc), param) from None
