"""The HTTP front's endpoints (runtime/api/http/app.py registers them on its app) and one
request's life on the server: submitted, then its outputs collected or streamed as
server-sent events. A request whose HTTP client goes away is cancelled on the server.

What goes in and out is OpenAI's: runtime/api/openai/requests.py turns a body into the
engine's arguments, runtime/api/openai/replies.py shapes the outputs (their logprobs:
openai/logprobs.py; token strings and echoed prompts: openai/tokens.py)."""

from __future__ import annotations

import asyncio
import os
import time

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from runtime.api.http.backend import AsyncWaiter, HttpClient
from runtime.api.openai.bodies import ChatCompletionRequest, CompletionRequest
from runtime.api.openai.errors import HttpError, engine_unavailable, server_draining
from runtime.api.openai.replies import DONE, ChatShapes, CompletionShapes, ResponseShapes, sse
from runtime.api.openai.requests import OpenAIRequest, parse_chat, parse_completion
from runtime.api.openai.structured import forced_grammar, tool_format
from runtime.api.openai.tokens import (
    Render,
    TokenizerSource,
    TokenStrings,
    make_render,
    needs_tokenizer,
)
from runtime.control.protocol import ClientReply, Delta, Failed, Final, Generate
from runtime.errors import EngineDeadError
from runtime.version import installed_version

DISCONNECT_POLL_S = 0.5  # how often a waiting request checks its HTTP client
HEALTH_TIMEOUT_S = 2.0  # /health: how long the server gets to answer its ping


class Routes:
    """The endpoints over one HttpClient."""

    def __init__(
        self,
        client: HttpClient,
        model_name: str | None,
        tokenizer_path: str | None = None,
        tool_parser: str | None = None,
    ):
        self.client = client
        # token strings (logprobs, echo) and the chat template (the tool-call format): the
        # server's tokenizer, loaded here on first need
        self.tokens = TokenizerSource(tokenizer_path)
        self.tool_parser = tool_parser  # server.tool_parser; None: the chat template's
        # the served model id: `--served-model-name`, else (found on the first request) the
        # target's file or directory name, when its full path is accepted too
        self.model = model_name
        self.named = model_name is not None
        self.created = int(time.time())

    # --- the served model -----------------------------------------------------------------
    async def info(self) -> dict:
        info = self.client._info  # cached after the first answer
        if info is None:
            try:
                info = await asyncio.to_thread(self.client.info, 30.0)
            except EngineDeadError as exc:
                raise engine_unavailable(exc) from None
        return info

    async def model_id(self) -> str:
        if self.model is None:
            path = str((await self.info()).get("model", "tandem"))
            self.model = os.path.basename(path.rstrip("/")) or path
        return self.model

    async def check_model(self, requested: str) -> str:
        """The served model's id, when `requested` names it (else a 404)."""
        name = await self.model_id()
        accepted = {name} if self.named else {name, str((await self.info()).get("model"))}
        if requested not in accepted:
            raise self.not_found(requested, name)
        return name

    @staticmethod
    def not_found(requested: str, name: str) -> HttpError:
        return HttpError(
            404,
            f"The model `{requested}` does not exist; this server serves `{name}`",
            "model",
            code="model_not_found",
        )

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "tandem"}

    # --- the endpoints --------------------------------------------------------------------
    async def health(self):
        """200 while the server serves; 503 while it drains (SIGTERM: a balancer stops
        sending requests here), is starting, or does not answer within HEALTH_TIMEOUT_S."""
        try:
            info = await asyncio.to_thread(self.client.info, HEALTH_TIMEOUT_S)
        except EngineDeadError as exc:
            raise engine_unavailable(exc) from None
        if info.get("draining"):
            raise server_draining(
                "the server is shutting down (draining): it finishes the "
                "requests in flight and takes no new ones"
            )
        return {"status": "ok"}

    async def metrics(self):
        """The server's exposition (prometheus_client.generate_latest: the 0.0.4 text
        format) with its content type."""
        try:
            text = await asyncio.to_thread(self.client.metrics, 30.0)
        except EngineDeadError as exc:
            raise engine_unavailable(exc) from None
        return Response(text, media_type=CONTENT_TYPE_PLAIN_0_0_4)

    async def models(self):
        """The served model (one)."""
        return {"object": "list", "data": [self.model_card(await self.model_id())]}

    async def one_model(self, name: str):
        """The served model, when `name` is its id (else a 404)."""
        served = await self.model_id()
        if name != served:
            raise self.not_found(name, served)
        return self.model_card(name)

    async def version(self):
        """tandem's version, as vLLM's /version gives its own."""
        return {"version": installed_version() or "unknown"}

    async def completions(self, request: Request, body: CompletionRequest):
        """A completion of each prompt (n choices each), or with stream: true, its chunks as
        server-sent events, ending with `data: [DONE]`."""
        name = await self.check_model(body.model)
        return await self.answer(request, parse_completion(body), CompletionShapes, name)

    async def chat_completions(self, request: Request, body: ChatCompletionRequest):
        """The assistant's next message after `messages` (the chat template over all of
        them), or with stream: true, its chunks as server-sent events, ending with
        `data: [DONE]`."""
        name = await self.check_model(body.model)
        req = await self.read_tools(parse_chat(body))
        return await self.answer(request, req, ChatShapes, name)

    async def read_tools(self, req: OpenAIRequest) -> OpenAIRequest:
        """A chat request whose tools are called (tool_choice not "none"): its output read
        in the configured or the chat template's format, a forced choice's grammar set."""
        tools = req.tools
        if tools is None or not tools.parses:
            return req
        template = None
        if self.tool_parser is None:
            strings = await self.tokens.get(await self.info())
            template = getattr(strings.tokenizer, "chat_template", None)
        parser = tool_format(tools, self.tool_parser, template)
        grammar = await asyncio.to_thread(forced_grammar, tools, parser) if tools.forced else None
        return req.reading_tools(parser, grammar)

    # --- one request on the server --------------------------------------------------------
    async def answer(
        self,
        request: Request,
        req: OpenAIRequest,
        shapes_of: type[ResponseShapes],
        name: str,
    ):
        """The whole response, or a stream of its chunks."""
        await self.info()  # cached after the first call; token-id validation needs it
        try:
            msg = self.client.build(stream=req.stream, **req.build_kwargs)
        except ValueError as exc:
            raise req.refusal(exc) from None
        shapes = shapes_of(name, req, await self.render(req))
        rid, waiter, first = await self.submit(request, req, msg)
        if not req.stream:
            return shapes.response(await self.collect(request, rid, waiter, first, req))
        return self.stream(rid, waiter, first, shapes, req)

    async def render(self, req: OpenAIRequest) -> Render:
        """What the response shows beyond the outputs (token strings, echoed prompts, prompt
        token counts); the tokenizer is loaded only for a request that needs it."""
        wants = (req.logprobs is not None, req.echo, req.continuous_usage)
        if not needs_tokenizer(req.build_kwargs, *wants):
            return make_render(req.build_kwargs, TokenStrings(), *wants)
        strings = await self.tokens.get(await self.info())
        return make_render(req.build_kwargs, strings, *wants)

    async def submit(self, request: Request, req: OpenAIRequest, msg: Generate):
        """(message id, waiter, first reply) once the server has answered; a 400/503
        HttpError if it refused the request."""
        try:
            waiter = self.client.open_async(msg)
        except EngineDeadError as exc:
            raise engine_unavailable(exc) from None
        rid, done = msg.id, False
        try:
            while True:
                try:
                    reply = await waiter.get(DISCONNECT_POLL_S)
                    break
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise HttpError(499, "client closed the request") from None
            if isinstance(reply, Failed):
                done = True
                raise req.failure(reply)
            if isinstance(reply, Final):
                done = True
                self.client.finish(rid, cancel=False)
            return rid, waiter, reply
        except BaseException:
            self.client.finish(rid, cancel=not done)
            raise

    async def collect(
        self,
        request: Request,
        rid: str,
        waiter: AsyncWaiter,
        reply: ClientReply,
        req: OpenAIRequest,
    ) -> list[dict]:
        """Wait for the final reply of a non-streamed request (cancelled if the HTTP client
        goes away meanwhile)."""
        done = isinstance(reply, Final)
        try:
            while not isinstance(reply, Final):
                try:
                    reply = await waiter.get(DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise HttpError(499, "client closed the request") from None
                    continue
                if isinstance(reply, Failed):
                    done = True
                    raise req.failure(reply)
            done = True
        finally:
            self.client.finish(rid, cancel=not done)
        return sorted(reply.outputs, key=lambda o: o["index"])

    def stream(
        self,
        rid: str,
        waiter: AsyncWaiter,
        first: ClientReply,
        shapes: ResponseShapes,
        req: OpenAIRequest,
    ) -> StreamingResponse:
        """The replies as server-sent events (the request is cancelled if the stream is
        closed before its end)."""

        async def events():
            done = isinstance(first, Final)
            reply = first
            try:
                for opening in shapes.opening_chunks():
                    yield sse(opening)
                while True:
                    if isinstance(reply, Delta):
                        for chunk in shapes.delta_chunks(reply):
                            yield sse(chunk)
                    elif isinstance(reply, (Final, Failed)):
                        done = True
                        for item in self._last_events(reply, shapes, req):
                            yield item
                        return
                    reply = await waiter.get()
            finally:
                self.client.finish(rid, cancel=not done)

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @staticmethod
    def _last_events(
        reply: Final | Failed, shapes: ResponseShapes, req: OpenAIRequest
    ) -> list[bytes]:
        """A stream's end: each choice's finish (and the usage), or the error; then [DONE]."""
        if isinstance(reply, Failed):
            return [sse(req.failure(reply).body()), DONE]
        outputs = sorted(reply.outputs, key=lambda o: o["index"])
        return [sse(c) for c in shapes.closing_chunks(outputs)] + [DONE]
