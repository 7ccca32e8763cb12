"""The request bodies of POST /v1/completions and /v1/chat/completions as pydantic models:
one definition of each argument (its type, bounds, default and description), from which
FastAPI validates a body, the 400s name the argument (runtime/api/openai/errors.py
validation_error) and /openapi.json describes it. OpenAI's arguments, vLLM's extensions
(top_k, min_p, repetition_penalty, structured_outputs, ...), OpenAI's arguments this server
accepts only "off" (best_of, suffix, functions, ...: another value is a 400 naming them) and
those it accepts and ignores (user, metadata, ...). An unknown argument is a 400 naming it.
A null is the argument's default. What the arguments become: openai/requests.py; the checks
that need the model (the vocabulary, the server's caps, max_seq_len) are the engine's."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from runtime.api.openai.fields import Flag, LogitBias, Only, Prompt, Range, Strings, TokenIds
from runtime.api.openai.schemas import (
    MESSAGES,
    RESPONSE_FORMAT,
    STRUCTURED_OUTPUTS,
    TOOL_CHOICE,
    TOOLS,
)
from runtime.params import MAX_LOGPROBS, PENALTY_LIMIT

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; used for chat as well
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2] (the Python API takes any finite T >= 0)


class Body(BaseModel):
    """A JSON object of known arguments, each checked as its type says (no coercion: a bool
    is not a number, "1" not an integer); a null is the argument's default."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(Body):
    include_usage: Flag = Field(False, description="a last chunk with the usage")
    continuous_usage_stats: Flag = Field(
        False, description="(vLLM) the usage so far on every chunk; with include_usage"
    )
    include_obfuscation: Flag | None = Field(None, description="accepted and ignored")


class Sampling(Body):
    """What both routes take: the model, the sampling arguments, streaming, structured
    outputs, and the arguments accepted and ignored."""

    model: str = Field(min_length=1, description="the served model's id (GET /v1/models)")
    temperature: Annotated[float, Range(0, MAX_TEMPERATURE)] | None = Field(
        1.0, description="sampling temperature; 0 is greedy"
    )
    top_p: Annotated[float, Range(0, 1, low_open=True)] | None = Field(
        1.0, description="nucleus sampling: the smallest set of tokens with this probability"
    )
    top_k: Annotated[int, Range(-1)] | None = Field(
        None, description="(vLLM) the k most likely tokens only; -1, 0 or null: all"
    )
    min_p: Annotated[float, Range(0, 1)] | None = Field(
        0.0, description="(vLLM) tokens at least min_p times the most likely's probability"
    )
    seed: Annotated[int, Range(0)] | None = Field(
        None, description="a seed: the same request gives the same output"
    )
    stop: Strings | None = Field(None, description="up to these strings (not included)")
    stop_token_ids: TokenIds | None = Field(None, description="(vLLM) stop at these tokens")
    include_stop_str_in_output: Flag | None = Field(
        False, description="(vLLM) the stop string ends the text"
    )
    ignore_eos: Flag | None = Field(False, description="(vLLM) go on past end-of-sequence")
    min_tokens: Annotated[int, Range(0)] | None = Field(
        0, description="(vLLM) no stop before this many tokens"
    )
    skip_special_tokens: Flag | None = Field(
        True, description="(vLLM) special tokens are left out of the text"
    )
    presence_penalty: Annotated[float, Range(-PENALTY_LIMIT, PENALTY_LIMIT)] | None = Field(
        0.0, description="lowers the logits of tokens generated already"
    )
    frequency_penalty: Annotated[float, Range(-PENALTY_LIMIT, PENALTY_LIMIT)] | None = Field(
        0.0, description="lowers the logits of tokens by how often they were generated"
    )
    repetition_penalty: Annotated[float, Range(0, low_open=True)] | None = Field(
        1.0, description="(vLLM) divides the logits of tokens seen in the prompt or output"
    )
    logit_bias: LogitBias | None = Field(None, description="{token id: bias in [-100, 100]}")
    n: Annotated[int, Range(1)] | None = Field(
        1, description="choices per prompt (at most the server's server.max_n)"
    )
    stream: Flag | None = Field(False, description="server-sent events, ending with [DONE]")
    stream_options: StreamOptions | None = Field(None, description="with stream: usage")
    response_format: Annotated[Any, WithJsonSchema(RESPONSE_FORMAT)] = Field(
        None, description="text, json_object or json_schema (enforced)"
    )
    structured_outputs: Annotated[Any, WithJsonSchema(STRUCTURED_OUTPUTS)] = Field(
        None, description="(vLLM) the output follows a JSON schema, regex, choice or grammar"
    )
    user: str | None = Field(None, description="accepted and ignored")
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")
    store: bool | None = Field(None, description="accepted and ignored")
    service_tier: str | None = Field(None, description="accepted and ignored")
    reasoning_effort: str | None = Field(None, description="accepted and ignored")
    prompt_cache_key: str | None = Field(None, description="accepted and ignored")
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    verbosity: str | None = Field(None, description="accepted and ignored")


class CompletionRequest(Sampling):
    """POST /v1/completions."""

    prompt: Prompt = Field(
        description="a string, a list of strings, a list of token ids or a list of such lists"
    )
    max_tokens: Annotated[int, Range(0)] | None = Field(
        DEFAULT_MAX_TOKENS, description="most tokens generated per choice (0: with echo)"
    )
    echo: Flag | None = Field(False, description="the prompt before each choice's text")
    logprobs: Annotated[int, Range(0, MAX_LOGPROBS)] | None = Field(
        None, description="the logprobs of each token and of its N most likely alternatives"
    )
    best_of: Annotated[Any, Only({"type": "integer", "enum": [1]}, 1)] = Field(
        None, description="1 only (as vLLM)"
    )
    suffix: Annotated[Any, Only({"type": "string", "enum": [""]}, "")] = Field(
        None, description="not supported: empty only"
    )


class ChatCompletionRequest(Sampling):
    """POST /v1/chat/completions: the chat template over the whole message list."""

    messages: Annotated[Any, WithJsonSchema(MESSAGES)] = Field(
        description="the conversation (text content; tool calls and their results)"
    )
    max_completion_tokens: Annotated[int, Range(0)] | None = Field(
        None, description=f"most tokens generated per choice (default {DEFAULT_MAX_TOKENS})"
    )
    max_tokens: Annotated[int, Range(0)] | None = Field(
        None, description="max_completion_tokens' older name"
    )
    logprobs: Flag | None = Field(False, description="the logprobs of each generated token")
    top_logprobs: Annotated[int, Range(0, MAX_LOGPROBS)] | None = Field(
        None, description="with logprobs: each token's N most likely alternatives"
    )
    tools: Annotated[Any, WithJsonSchema(TOOLS)] = Field(None, description="function tools")
    tool_choice: Annotated[Any, WithJsonSchema(TOOL_CHOICE)] = Field(
        None, description="none, auto (the default with tools), required or a named function"
    )
    parallel_tool_calls: Flag | None = Field(
        None, description="false: one call at most (true by default)"
    )
    echo: Annotated[Any, Only({"type": "boolean", "enum": [False]}, False)] = Field(
        None, description="(vLLM) not supported: false only"
    )
    functions: Annotated[Any, Only({"type": "array", "maxItems": 0}, [])] = Field(
        None, description="OpenAI's legacy functions: not supported (use tools)"
    )
    function_call: Annotated[
        Any, Only({"type": "string", "enum": ["none", "auto"]}, "none", "auto")
    ] = Field(
        None, description="OpenAI's legacy function_call: none or auto only (use tool_choice)"
    )
    audio: Annotated[Any, Only({"type": "null"})] = Field(None, description="not supported")
    prediction: Annotated[Any, Only({"type": "null"})] = Field(None, description="not supported")
    modalities: Annotated[Any, Only({"type": "array", "items": {"enum": ["text"]}}, ["text"])] = (
        Field(None, description='["text"] only')
    )
    web_search_options: Annotated[Any, Only({"type": "null"})] = Field(
        None, description="not supported"
    )
