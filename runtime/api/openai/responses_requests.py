"""The body of POST /v1/responses (OpenAI's Responses API) as a pydantic model, and its
mapping onto a chat completion's body (runtime/api/openai/requests.py parses that: the same
engine path, tool-call formats and grammars as /v1/chat/completions).

Stateless: nothing is stored (`store` is accepted and ignored), so `previous_response_id`
and `conversation` are refused (a 400 naming them), as are background responses. What maps:
- `input`: a string (one user message), or a list of items: messages ({"role", "content"},
  role user | assistant | system | developer; content a string or parts of type input_text
  (output_text for an assistant's earlier output)), function_call items (an assistant's
  tool calls; consecutive ones, and the message just before them, are one assistant turn)
  and function_call_output items (a tool message answering `call_id`);
- `instructions`: a system message first;
- `max_output_tokens` -> max_tokens; temperature, top_p, seed and vLLM's sampling extensions
  as chat takes them;
- `tools` ({"type": "function", "name", "description", "parameters", "strict"}) and
  `tool_choice` ("none" | "auto" | "required" | {"type": "function", "name"}) in chat's
  shapes; `parallel_tool_calls` as is;
- `text.format` (text | json_object | json_schema {"name", "schema", "strict"}) ->
  response_format."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, Tag

from runtime.api.openai.errors import HttpError


class _Item(BaseModel):
    """An input item: the fields read here; others (an earlier output's id, status,
    annotations) are ignored."""

    model_config = ConfigDict(extra="ignore")


class TextPart(_Item):
    type: Literal["input_text", "output_text"]
    text: str


def _kind(value: Any) -> str:
    """An input item's type; a message may leave it out (OpenAI's EasyInputMessage)."""
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return str(getattr(value, "type", "message"))


class Message(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCall(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n".join(part.text for part in self.output)


InputItem = Annotated[
    Annotated[Message, Tag("message")]
    | Annotated[FunctionCall, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")],
    Discriminator(_kind),
]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """text.format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
    "name", "schema", "strict", "description"}."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, ignored


Number = float | int


class ResponsesRequest(BaseModel):
    """POST /v1/responses' body (the arguments this server takes; any other is a 400)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    stream: StrictBool = False
    # stateless: accepted only with their "off" values (checked in to_chat)
    store: StrictBool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: StrictBool | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    # accepted, ignored
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    # sampling (vLLM's extensions of the Responses API)
    seed: int | None = None
    top_k: int | None = None
    min_p: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    stop: str | list[str] | None = None


SAMPLING = (
    "temperature",
    "top_p",
    "seed",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "parallel_tool_calls",
)
# a chat argument's name in a Responses body (errors name the argument the client gave)
RESPONSES_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
}


def to_chat(req: ResponsesRequest) -> dict:
    """The chat completion body of a Responses request (a 400 naming what is refused)."""
    _refuse_state(req)
    body: dict = {
        "model": req.model,
        "messages": chat_messages(req.input, req.instructions),
        "stream": req.stream,
    }
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    body.update({k: getattr(req, k) for k in SAMPLING if getattr(req, k) is not None})
    if req.tools:
        body["tools"] = [_chat_tool(tool) for tool in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = (
            choice
            if isinstance(choice, str)
            else {"type": "function", "function": {"name": choice.name}}
        )
    if req.text is not None and req.text.format is not None:
        body["response_format"] = _response_format(req.text.format)
    return body


def _refuse_state(req: ResponsesRequest) -> None:
    """What needs stored responses, or runs apart from the request: a 400 naming it."""
    if req.previous_response_id is not None:
        raise HttpError(
            400,
            "previous_response_id: this server stores no responses (stateless, as store: "
            "false); send the whole conversation as input",
            "previous_response_id",
        )
    if req.conversation is not None:
        raise HttpError(400, "conversation: this server stores no conversations", "conversation")
    if req.background:
        raise HttpError(400, "background: background responses are not supported", "background")
    if req.include:
        raise HttpError(400, f"include: {req.include[0]!r} is not supported", "include")


def chat_messages(given: str | list, instructions: str | None) -> list[dict]:
    """The input items as chat messages (module docstring)."""
    items = [Message(role="user", content=given)] if isinstance(given, str) else given
    if not items:
        raise HttpError(400, "input: expected a string or a non-empty list of items", "input")
    messages: list[dict] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if isinstance(item, Message):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            _add_call(messages, item)
    return messages


def _add_call(messages: list[dict], item: FunctionCall) -> None:
    """A function call joins the assistant turn just before it, or starts one."""
    call = {
        "id": item.call_id,
        "type": "function",
        "function": {"name": item.name, "arguments": item.arguments},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _chat_tool(tool: FunctionTool) -> dict:
    function = tool.model_dump(exclude={"type"}, exclude_none=True)
    return {"type": "function", "function": function}


def _response_format(fmt: TextFormat) -> dict:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.name is None or fmt.json_schema is None:
        raise HttpError(
            400,
            'text.format: json_schema needs {"name": ..., "schema": {...}}',
            "text",
        )
    spec = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": spec}
