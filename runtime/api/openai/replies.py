"""OpenAI's response shapes for the HTTP front: a completion's or a chat completion's whole
response, its stream chunks (server-sent events, ending with `data: [DONE]`), finish reasons
and usage, made from the server's outputs (dicts with index, text, token_ids, finish_reason
and stats, and logprobs / prompt_logprobs when asked, as runtime.control.protocol.Final
carries them) and its Delta replies. Choice i is output i: prompt p's j-th of n samples is
p * n + j, as in vLLM. Logprobs' shapes: runtime/api/openai/logprobs.py."""

from __future__ import annotations

import json
import time
import uuid

from runtime.api.openai.logprobs import chat_logprobs, completion_logprobs
from runtime.api.openai.requests import OpenAIRequest
from runtime.api.openai.tokens import Render
from runtime.api.tools.parsers import (
    ToolCallStream,
    parse_tool_calls,
    tool_call_stream,
    tool_finish_reason,
)
from runtime.control.protocol import Delta

DONE = b"data: [DONE]\n\n"  # a stream's last event


def sse(obj) -> bytes:
    """One server-sent event holding `obj` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def counts(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def usage(outputs: list[dict], n: int = 1) -> dict:
    """Each prompt's tokens once (its n samples share it), every choice's generated tokens."""
    prompts = {o["index"] // n: int(o["stats"].get("prompt_tokens", 0)) for o in outputs}
    return counts(sum(prompts.values()), sum(len(o["token_ids"]) for o in outputs))


def finish_reason(reason: str | None) -> str:
    return reason if reason in ("stop", "length") else "stop"


def _plain_request() -> OpenAIRequest:
    return OpenAIRequest({"params": {}}, False, False, "max_tokens", "prompt")


class ResponseShapes:
    """One response's id, creation time and model, and the shapes that carry them; a
    subclass says what one choice looks like, whole and as a chunk, and its logprobs. A
    stream's chunks are made in order (the shapes count what each choice has streamed)."""

    id_prefix: str
    response_object: str
    chunk_object: str

    def __init__(self, model: str, req: OpenAIRequest | None = None, render: Render | None = None):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.req = _plain_request() if req is None else req
        self.render = Render() if render is None else render
        self.streamed: dict[int, list[int]] = {}  # choice -> [characters, tokens] streamed

    def _head(self, kind: str) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def choice(self, out: dict) -> dict:
        raise NotImplementedError

    def chunk_choice(
        self, index: int, text: str | None, finish: str | None, logprobs: dict | None = None
    ) -> dict:
        raise NotImplementedError

    def logprobs_of(self, index: int, token_ids: list[int], entries: list | None) -> dict:
        """The logprobs of `token_ids` (entries: the server's, one per token) of choice
        `index`, for a chunk."""
        raise NotImplementedError

    def response(self, outputs: list[dict]) -> dict:
        """The whole (non-streamed) response."""
        head = self._head(self.response_object)
        choices = [self.choice(o) for o in outputs]
        return {**head, "choices": choices, "usage": usage(outputs, self.req.n)}

    def chunk(
        self, index: int, text: str | None, finish: str | None, logprobs: dict | None = None
    ) -> dict:
        """A stream chunk: `text` generated for choice `index`, or its finish reason."""
        choice = self.chunk_choice(index, text, finish, logprobs)
        out = {**self._head(self.chunk_object), "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = self._usage_so_far(index) if self.req.continuous_usage else None
        return out

    def _usage_so_far(self, index: int) -> dict:
        """Choice `index`'s prompt and the tokens it has streamed (continuous_usage_stats)."""
        prompts = self.render.prompt_tokens
        prompt = prompts[index // self.req.n] if index // self.req.n < len(prompts) else 0
        return counts(prompt, self.streamed.get(index, [0, 0])[1])

    def delta_chunks(self, delta: Delta) -> list[dict]:
        """The chunks of one Delta reply: none when it shows nothing (no text, no logprobs)."""
        logprobs = self._take(delta)
        if not delta.text and logprobs is None:
            return []
        return [self.chunk(delta.index, delta.text, None, logprobs)]

    def _take(self, delta: Delta) -> dict | None:
        """Count what `delta` streams for its choice; its logprobs, when asked for."""
        sent = self.streamed.setdefault(delta.index, [0, 0])
        logprobs = None
        if self.req.logprobs is not None and delta.token_ids:
            logprobs = self.logprobs_of(delta.index, delta.token_ids, delta.logprobs)
        sent[0] += len(delta.text)
        sent[1] += len(delta.token_ids)
        return logprobs

    def opening_chunks(self) -> list[dict]:
        """The chunks a stream starts with, before any generated text."""
        return []

    def finish_chunks(self, out: dict) -> list[dict]:
        """The chunks that end choice `out` (its finish reason)."""
        return [self.chunk(out["index"], None, finish_reason(out["finish_reason"]))]

    def closing_chunks(self, outputs: list[dict]) -> list[dict]:
        """Each choice's finish reason, then (include_usage) one chunk with the usage."""
        chunks = [c for o in outputs for c in self.finish_chunks(o)]
        if self.req.include_usage:
            last = self.chunk(0, None, None)
            last["choices"], last["usage"] = [], usage(outputs, self.req.n)
            chunks.append(last)
        return chunks


class CompletionShapes(ResponseShapes):
    """/v1/completions: text_completion objects, whole and streamed; echo puts the prompt
    (and, with logprobs, its tokens) before each choice's."""

    id_prefix = "cmpl"
    response_object = "text_completion"
    chunk_object = "text_completion"

    def choice(self, out: dict) -> dict:
        text, logprobs = out["text"], None
        ids, entries = list(out["token_ids"]), out.get("logprobs")
        if entries is None:
            entries = [None] * len(ids)
        if self.req.echo:
            echo = self.render.echoes[out["index"] // self.req.n]
            text = echo.text + text
            prompt_ids = out.get("prompt_token_ids") or echo.ids
            prompt_entries = out.get("prompt_logprobs") or [None] * len(prompt_ids)
            ids, entries = [*prompt_ids, *ids], [*prompt_entries, *entries]
        if self.req.logprobs is not None:
            logprobs = completion_logprobs(ids, entries, self.render.text_of)
        return {
            "index": out["index"],
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(out["finish_reason"]),
        }

    def chunk_choice(
        self, index: int, text: str | None, finish: str | None, logprobs: dict | None = None
    ) -> dict:
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def logprobs_of(self, index: int, token_ids: list[int], entries: list | None) -> dict:
        offset = self.streamed.get(index, [0, 0])[0]
        entries = [None] * len(token_ids) if entries is None else entries
        return completion_logprobs(token_ids, entries, self.render.text_of, offset)

    def opening_chunks(self) -> list[dict]:
        """With echo, each choice's prompt text first."""
        chunks = []
        for p, echo in enumerate(self.render.echoes if self.req.echo else ()):
            for index in range(p * self.req.n, (p + 1) * self.req.n):
                self.streamed.setdefault(index, [0, 0])[0] += len(echo.text)
                chunks.append(self.chunk(index, echo.text, None))
        return chunks


class ChatShapes(ResponseShapes):
    """/v1/chat/completions: a chat.completion, or chat.completion.chunk objects whose first
    (for each choice) says the assistant's role. A request whose output is read for tool
    calls (req.tool_parser) has them in its message's tool_calls (runtime/api/tools/parsers.py),
    streamed as ToolCallStream's deltas: the stream adds up to the whole message."""

    id_prefix = "chatcmpl"
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, req: OpenAIRequest | None = None, render: Render | None = None):
        super().__init__(model, req, render)
        self.tool_streams: dict[int, ToolCallStream] = {}  # choice -> its calls so far

    def choice(self, out: dict) -> dict:
        logprobs = None
        if self.req.logprobs is not None:
            ids = list(out["token_ids"])
            logprobs = self.logprobs_of(out["index"], ids, out.get("logprobs"))
        message: dict = {"role": "assistant", "content": out["text"]}
        finish = finish_reason(out["finish_reason"])
        if self.req.tool_parser is not None:
            content, calls = parse_tool_calls(
                out["text"], self.req.tool_parser, tools=self.req.tools
            )
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
            finish = self._tool_finish(finish, bool(calls))
        return {
            "index": out["index"],
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
        }

    def _tool_finish(self, finish: str, has_calls: bool) -> str:
        """OpenAI's: "tool_calls" after calls, except for a named function's ("stop")."""
        tools = self.req.tools
        if tools is not None and tools.choice == "function":
            return finish
        return tool_finish_reason(finish, has_calls)

    def chunk_choice(
        self,
        index: int,
        text: str | None,
        finish: str | None,
        logprobs: dict | None = None,
        delta: dict | None = None,
    ) -> dict:
        if delta is None:
            delta = {} if text is None else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def logprobs_of(self, index: int, token_ids: list[int], entries: list | None) -> dict:
        entries = [None] * len(token_ids) if entries is None else entries
        return chat_logprobs(token_ids, entries, self.render.text_of, self.req.logprobs or 0)

    def opening_chunks(self) -> list[dict]:
        chunks = []
        for index in range(self.req.n):
            first = self.chunk(index, None, None)
            role = {"role": "assistant", "content": ""}
            first["choices"] = [self.chunk_choice(index, None, None, None, role)]
            chunks.append(first)
        return chunks

    # --- tool calls, streamed -----------------------------------------------------------
    def delta_chunks(self, delta: Delta) -> list[dict]:
        parser = self.req.tool_parser
        if parser is None:
            return super().delta_chunks(delta)
        logprobs = self._take(delta)
        stream = self._tool_stream(delta.index, parser)
        return self._tool_chunks(delta.index, stream.feed(delta.text), logprobs)

    def finish_chunks(self, out: dict) -> list[dict]:
        if self.req.tool_parser is None:
            return super().finish_chunks(out)
        parser, index = self.req.tool_parser, out["index"]
        stream = self._tool_stream(index, parser)
        chunks = self._tool_chunks(index, stream.finish(), None)
        finish = self._tool_finish(finish_reason(out["finish_reason"]), stream.has_calls)
        return [*chunks, self.chunk(index, None, finish)]

    def _tool_stream(self, index: int, parser: str) -> ToolCallStream:
        if index not in self.tool_streams:
            self.tool_streams[index] = tool_call_stream(parser, self.req.tools)
        return self.tool_streams[index]

    def _tool_chunks(self, index: int, deltas: list[dict], logprobs: dict | None) -> list[dict]:
        """A chunk per delta (content, or one call's part); the logprobs go with the first
        (or alone, when the text is held back)."""
        if not deltas and logprobs is None:
            return []
        chunks = []
        for i, delta in enumerate(deltas or [{}]):
            chunk = self.chunk(index, None, None)
            chunk["choices"] = [
                self.chunk_choice(index, None, None, logprobs if i == 0 else None, delta)
            ]
            chunks.append(chunk)
        return chunks
