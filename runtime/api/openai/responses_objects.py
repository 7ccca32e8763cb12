"""The reply of POST /v1/responses as pydantic models: the `response` object (OpenAI's
Responses API, the fields its SDK parses; `output_text` is the SDK's own sum of the message
items' text) and its output items, an assistant message of output_text parts and
function_call items. runtime/api/openai/responses_events.py builds them, whole or streamed."""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from runtime.api.openai.responses_requests import ResponsesRequest

Status = Literal["in_progress", "completed", "incomplete", "failed"]


def new_id(prefix: str) -> str:
    """An OpenAI-style id: `prefix`_ and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str = Field(default_factory=lambda: new_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Status = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    id: str = Field(default_factory=lambda: new_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: Status = "in_progress"


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


def usage_of(out: dict) -> Usage:
    """The usage of one server output (its stats' prompt_tokens and cached_prompt_tokens)."""
    stats = out.get("stats") or {}
    prompt, generated = int(stats.get("prompt_tokens", 0)), len(out.get("token_ids", ()))
    cached = InputTokensDetails(cached_tokens=int(stats.get("cached_prompt_tokens", 0)))
    return Usage(
        input_tokens=prompt,
        input_tokens_details=cached,
        output_tokens=generated,
        total_tokens=prompt + generated,
    )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ErrorDetails(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A response, as created (status in_progress, no output) and as it ends."""

    id: str = Field(default_factory=lambda: new_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Status = "in_progress"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: Usage | None = None
    error: ErrorDetails | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = True
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool = False
    background: bool = False
    previous_response_id: None = None
    reasoning: None = None
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, Any] = Field(default_factory=dict)
    user: str | None = None


def echo_of(req: ResponsesRequest, model: str) -> ResponseObject:
    """A new response that echoes the request's settings (as OpenAI's does)."""
    choice: Any = req.tool_choice if req.tool_choice is not None else "auto"
    if not isinstance(choice, str):
        choice = choice.model_dump()
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else None
    return ResponseObject(
        model=model,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's defaults
        top_p=1.0 if req.top_p is None else req.top_p,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        tool_choice=choice,
        tools=[t.model_dump(exclude_none=True) for t in req.tools or ()],
        text=text or {"format": {"type": "text"}},
        metadata=req.metadata or {},
        user=req.user,
    )
