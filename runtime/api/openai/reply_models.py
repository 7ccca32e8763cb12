"""The response bodies of the HTTP front as pydantic models: what /openapi.json shows, and
what the routes' answers are checked against and serialised by (FastAPI's response_model,
with exclude_unset: a key the answer leaves out, such as a message's tool_calls, stays out).
The answers themselves are made as dicts by runtime/api/openai/replies.py (and
openai/logprobs.py); a stream's chunks (server-sent events) are written from those dicts
directly, and their models here describe them (the "stream: true" answer)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ModelCard(BaseModel):
    id: str = Field(description="the id requests name in `model`")
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, or server_error")
    param: str | None = Field(description="the request argument at fault")
    code: str | None


class ErrorBody(BaseModel):
    """Every error: a 400 for a bad argument (never FastAPI's 422), 404 for an unknown
    model, 503 when the engine is gone."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: per token, its text, logprob (null for a prompt's first),
    the top alternatives and where its text starts."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


FinishReason = Literal["stop", "length", "tool_calls"]


class Head(BaseModel):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class Completion(Head):
    """POST /v1/completions, stream false: object "text_completion"."""

    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(Head):
    """POST /v1/completions, stream true: each event's data (object "text_completion"); the
    last (stream_options.include_usage) has no choices and the usage."""

    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(None, description="present when calls were made")


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletion(Head):
    """POST /v1/chat/completions, stream false: object "chat.completion"."""

    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(Head):
    """POST /v1/chat/completions, stream true: each event's data (object
    "chat.completion.chunk"); each choice's first says the role."""

    choices: list[ChatChunkChoice]
    usage: Usage | None = None
