"""Errors the public API raises."""


class EngineDeadError(RuntimeError):
    """The engine (a worker, the orchestrator or the server) is gone or unreachable."""


class RequestError(ValueError):
    """The server refused a request (bad arguments); the engine keeps serving."""
