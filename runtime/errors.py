"""Errors the public API raises."""


class EngineDeadError(RuntimeError):
    """The engine (a worker, the orchestrator or the server) is gone or unreachable."""


class EngineClosedError(EngineDeadError):
    """The Client or Engine was closed: every call still waiting when close() was called
    raises it, and so does every call after. An EngineDeadError, so that code that handles
    a dead engine handles a closed one too."""


class RequestError(ValueError):
    """The server refused a request (bad arguments); the engine keeps serving."""
