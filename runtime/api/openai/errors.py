"""The OpenAI-style error of the HTTP front: an HttpError carries the status and the
`{"error": {...}}` body that the app answers with (runtime/api/http/app.py registers its
handler), naming the request argument at fault where there is one (`param`): a body its pydantic
model refused (validation_error), or an argument the engine refused."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class HttpError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status,
            message,
            param,
            kind,
            code,
        )
        self.headers = headers  # of the response (Retry-After)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def engine_unavailable(detail: object) -> HttpError:
    """The 503 for a dead or unreachable engine (`detail`: what the Client said)."""
    return HttpError(
        503, f"the engine is not available: {detail}", kind="server_error", code="engine_dead"
    )


RETRY_AFTER_S = 5  # a draining server's Retry-After: a balancer has moved on by then, or a
# restarted server (systemd) may be up


def server_draining(message: str) -> HttpError:
    """The 503 of a server that is shutting down (draining: runtime.serving.server): it
    takes no new requests, while those in flight finish; `message`: the server's words."""
    return HttpError(
        503,
        message,
        kind="server_error",
        code="server_draining",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def validation_error(errors: Sequence[Mapping[str, Any]], body: Any = None) -> HttpError:
    """The 400 for a body its pydantic model refused (FastAPI's RequestValidationError, or
    pydantic's ValidationError: `errors()`), for the first error: `param` is the top-level
    argument at fault (OpenAI's), the message says where inside it ("logit_bias.5: ...") and
    what is accepted; an unknown argument is refused in OpenAI's words."""
    # the deepest error: of a union's branches (a string, or a list of items), the one that
    # went furthest into the value given
    error = max(errors, key=lambda e: len([p for p in e["loc"] if p != "[key]"]))
    loc = [part for part in error["loc"] if part != "[key]"]
    if loc and loc[0] == "body":  # FastAPI's: where the value came from
        loc = loc[1:]
    kind = error["type"]
    if isinstance(body, dict):  # as written in the body: no pydantic union branch names
        loc = _path(body, loc, kind in ("missing", "extra_forbidden"))
    if kind == "json_invalid":
        return HttpError(400, "the request body is not valid JSON")
    if not loc:
        if isinstance(error.get("input"), (bytes, bytearray)):  # another content type
            return HttpError(400, "the request body must be JSON (Content-Type: application/json)")
        return HttpError(400, "the request body must be a JSON object")
    param = str(loc[0])
    where = param + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    if kind == "extra_forbidden":
        if len(loc) == 1:
            return HttpError(400, f"Unrecognized request argument supplied: {param}", param)
        parent = ".".join(str(part) for part in loc[:-1])
        return HttpError(400, f"{parent}: unknown field {str(loc[-1])!r}", param)
    if kind == "missing":
        return HttpError(400, f"{where}: this argument is required", param)
    if kind == "value_error":  # the field type's own check (runtime/api/openai/fields.py)
        return HttpError(400, f"{where}: {error['ctx']['error']}", param)
    got = repr(error.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return HttpError(400, f"{where}: {error['msg']}, got {got}", param)


def _path(body: Any, loc: list, named: bool) -> list:
    """The error's location as written in the body: the keys and indices found there (and a
    missing or unknown key last); pydantic's names of union branches in between left out."""
    out: list = []
    here = body
    for i, part in enumerate(loc):
        if isinstance(here, dict) and part in here:
            out.append(part)
            here = here[part]
        elif isinstance(here, list) and isinstance(part, int) and 0 <= part < len(here):
            out.append(part)
            here = here[part]
        elif named and i == len(loc) - 1 and isinstance(part, str):
            out.append(part)
    return out
