"""A typed route's body refused by its pydantic model (FastAPI's RequestValidationError) as
the front's OpenAI-style 400 (openai.errors.HttpError) naming the argument at fault: the
deepest error's top-level field is `param`, its path and pydantic's words the message; an
unknown argument says so as OpenAI does, an undecodable body or one that is no JSON object
says that."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from runtime.api.openai.errors import HttpError


def validation_error(exc: RequestValidationError) -> HttpError:
    errors = exc.errors()
    if not errors:
        return HttpError(400, "the request body is not valid")
    # the deepest error: of a union's branches (a string, or a list of items), the one that
    # went furthest into the value given
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    kind = str(first.get("type", ""))
    body = getattr(exc, "body", None)
    if kind == "json_invalid":
        return HttpError(400, "the request body is not valid JSON")
    if isinstance(body, bytes):  # not sent as JSON: FastAPI did not decode it
        return HttpError(400, "the request body must be JSON (Content-Type: application/json)")
    named = kind in ("missing", "extra_forbidden")  # the error names a key not (rightly) there
    loc = _path(body, list(first.get("loc", ()))[1:], named)
    if not loc:
        return HttpError(400, "the request body must be a JSON object")
    param = str(loc[0])
    where = param + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    if kind == "extra_forbidden" and len(loc) == 1:
        return HttpError(400, f"Unrecognized request argument supplied: {param}", param)
    if kind == "missing":
        return HttpError(400, f"{where}: this argument is required", param)
    return HttpError(400, f"{where}: {first.get('msg', 'invalid value')}", param)


def _path(body, loc: list, named: bool) -> list:
    """The error's location as written in the body: the keys and indices found there (and a
    missing key last); pydantic's names of union branches in between are left out."""
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
            out.append(part)  # a missing (or unknown) key
    return out


async def handle_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)  # registered for it only
    error = validation_error(exc)
    return JSONResponse(error.body(), status_code=error.status)
