"""The OpenAI-style error of the HTTP front: an HttpError carries the status and the
`{"error": {...}}` body that the app answers with (runtime/api/http_api.py registers its
handler), naming the request argument at fault where there is one."""

from __future__ import annotations


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
