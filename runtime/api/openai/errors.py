"""The OpenAI-style error of the HTTP front: an HttpError carries the status and the
`{"error": {...}}` body that the app answers with (runtime/api/http/app.py registers its
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


def engine_unavailable(detail: object) -> HttpError:
    """The 503 for a dead or unreachable engine (`detail`: what the Client said)."""
    return HttpError(
        503, f"the engine is not available: {detail}", kind="server_error", code="engine_dead"
    )
