"""The HTTP front's API key at the door: an ASGI middleware that answers 401 to any request
without `Authorization: Bearer KEY` before it reaches a route (the key comes from
runtime/api/http/access.py).

Open without the key: OPEN_PATHS only (as vLLM: probes, scrapers and a version check must not
need the key). Everything else needs it, unknown paths included (a 401, not a 404, so that
nothing is learnt without the key): the `/v1/*` API, `/tokenize`, `/detokenize`,
`/openapi.json` and `/docs`. The key is compared in constant time (SHA-256 digests compared
with hmac.compare_digest, so neither its bytes nor its length leak through timing), and the
401 is OpenAI's error object, which says nothing of the key."""

from __future__ import annotations

import hashlib
import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.api.openai.errors import HttpError

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def bearer_token(scope: Scope) -> bytes | None:
    """The token of the request's `Authorization: Bearer TOKEN` header (the scheme in any
    case), or None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def unauthorized(token: bytes | None) -> HttpError:
    """The 401 of a request that sent no key (`token` None) or a wrong one."""
    if token is None:
        message = "This server needs an API key: send the header `Authorization: Bearer KEY`."
    else:
        message = "Incorrect API key provided."
    return HttpError(401, message, kind="invalid_request_error", code="invalid_api_key")


class KeyGuard:
    """ASGI middleware: requests to paths outside `open_paths` need the bearer `key`."""

    def __init__(self, app: ASGIApp, key: str, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self._digest = _digest(key.encode("ascii"))
        self.open_paths = open_paths

    def allows(self, scope: Scope) -> tuple[bool, bytes | None]:
        """(whether the request may pass, the token it sent)."""
        if scope["path"] in self.open_paths:
            return True, None
        token = bearer_token(scope)
        if token is None:
            return False, None
        return hmac.compare_digest(_digest(token), self._digest), token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        ok, token = self.allows(scope)
        if ok:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # none is served; refused (403) all the same
            await send({"type": "websocket.close", "code": 1008})
            return
        error = unauthorized(token)
        response = JSONResponse(
            error.body(), status_code=error.status, headers={"WWW-Authenticate": "Bearer"}
        )
        await response(scope, receive, send)
