"""POST /v1/responses (OpenAI's Responses API, stateless) over the chat completions'
machinery: the body (openai.responses_requests.ResponsesRequest, validated by FastAPI: a bad one
is a 400 naming the argument, http/openapi.py) becomes a chat completion's body, which
is parsed, submitted and collected as /v1/chat/completions' is (runtime/api/http/routes.py);
the outputs become a response object or its stream of events (openai/responses_events.py),
server-sent as `event: TYPE` / `data: JSON`, with no `[DONE]` (as OpenAI's)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from runtime.api.http.backend import AsyncWaiter
from runtime.api.http.routes import Routes
from runtime.api.openai.bodies import ChatCompletionRequest
from runtime.api.openai.errors import HttpError, validation_error
from runtime.api.openai.requests import parse_chat
from runtime.api.openai.responses_events import ResponseEvents
from runtime.api.openai.responses_objects import echo_of
from runtime.api.openai.responses_requests import RESPONSES_NAMES, ResponsesRequest, to_chat
from runtime.api.tools.parsers import tool_call_stream
from runtime.control.protocol import ClientReply, Delta, Failed, Final


def event_bytes(event: dict) -> bytes:
    """One server-sent event of the Responses API: its type, then its JSON."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def renamed(error: HttpError) -> HttpError:
    """A 400 of the chat machinery naming the Responses argument instead (messages ->
    input, max_tokens -> max_output_tokens, response_format -> text)."""
    name = RESPONSES_NAMES.get(error.param or "")
    if name is None:
        return error
    message = re.sub(rf"^{error.param}\b", name, error.message)
    return HttpError(error.status, message, name, error.kind, error.code)


class ResponsesRoute:
    """The endpoint over the chat completions' Routes."""

    def __init__(self, routes: Routes):
        self.routes = routes

    async def create(self, request: Request, body: ResponsesRequest):
        try:
            return await self._create(request, body)
        except HttpError as error:
            raise renamed(error) from None

    async def _create(self, request: Request, body: ResponsesRequest):
        routes = self.routes
        name = await routes.check_model(body.model)
        raw = to_chat(body)
        try:
            chat = ChatCompletionRequest.model_validate(raw)
        except ValidationError as exc:
            raise validation_error(exc.errors(), raw) from None
        req = await routes.read_tools(parse_chat(chat))
        req = replace(req, max_name="max_output_tokens", prompt_name="input")
        await routes.info()  # cached after the first call; token-id validation needs it
        try:
            msg = routes.client.build(stream=req.stream, **req.build_kwargs)
        except ValueError as exc:
            raise req.refusal(exc) from None
        reader = None if req.tool_parser is None else tool_call_stream(req.tool_parser, req.tools)
        events = ResponseEvents(echo_of(body, name), reader)
        rid, waiter, first = await routes.submit(request, req, msg)
        if not req.stream:
            outputs = await routes.collect(request, rid, waiter, first, req)
            return events.whole(outputs[0])
        return self.stream(rid, waiter, first, events, req.failure)

    def stream(
        self,
        rid: str,
        waiter: AsyncWaiter,
        first: ClientReply,
        events: ResponseEvents,
        failure: Callable[[Failed], HttpError],
    ) -> StreamingResponse:
        """The response's events as they come (the request is cancelled if the stream is
        closed before its end)."""
        client = self.routes.client

        async def sent():
            done = isinstance(first, Final)
            reply = first
            try:
                for event in events.opening():
                    yield event_bytes(event)
                while True:
                    if isinstance(reply, Delta):
                        for event in events.feed(reply.text):
                            yield event_bytes(event)
                    elif isinstance(reply, (Final, Failed)):
                        done = True
                        for event in self._last(reply, events, failure):
                            yield event_bytes(event)
                        return
                    reply = await waiter.get()
            finally:
                client.finish(rid, cancel=not done)

        return StreamingResponse(
            sent(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @staticmethod
    def _last(
        reply: Final | Failed, events: ResponseEvents, failure: Callable[[Failed], HttpError]
    ) -> list[dict]:
        if isinstance(reply, Failed):
            return events.fail(renamed(failure(reply)))
        out = min(reply.outputs, key=lambda o: o["index"])
        return events.finish(out)
