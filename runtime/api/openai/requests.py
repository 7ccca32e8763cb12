"""OpenAI request bodies (runtime/api/openai/bodies.py: the arguments each route accepts,
their checks and OpenAI's defaults) as the engine's arguments: the prompt or messages and
the sampling arguments (runtime.params.SamplingParams' keywords) they give, and the checks
that span arguments: completions' logprobs=N and echo become logprobs / prompt_logprobs,
chat's logprobs + top_logprobs become logprobs; and the engine's refusals turned into 400s
that name the OpenAI argument. A chat's tools, tool_choice, response_format and vLLM's
structured_outputs: runtime/api/openai/structured.py. Nothing here talks to the server.
docs/sampling.md has the table of every argument."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from runtime.api.openai.bodies import (
    DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    Sampling,
)
from runtime.api.openai.errors import HttpError, engine_unavailable, server_draining
from runtime.api.openai.structured import chat_tools, structured_outputs
from runtime.api.tools.request import ToolRequest
from runtime.control.protocol import Failed
from runtime.errors import ArgumentError
from runtime.serving.chat import chat_messages_with_tools

# SamplingParams' arguments passed on as they come (the engine checks them again)
PASSED_ON = (
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "n",
    "min_p",  # the rest: vLLM's extensions
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
)
# the names a refusal's param may be: the bodies' arguments
ARGUMENTS = frozenset(CompletionRequest.model_fields) | frozenset(
    ChatCompletionRequest.model_fields
)


@dataclass(frozen=True)
class OpenAIRequest:
    """One request body as the engine's arguments, what its response shows, and the OpenAI
    names its errors use."""

    build_kwargs: dict  # HttpClient.build's: prompt, prompt_token_ids or messages; params
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    max_name: str  # the OpenAI argument that gave max_new_tokens
    prompt_name: str  # the OpenAI argument that gave the prompt
    n: int = 1  # choices per prompt
    logprobs: int | None = None  # top alternatives per token shown (None: no logprobs)
    echo: bool = False  # completions: the prompt before each choice's text (and logprobs)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage per chunk
    tools: ToolRequest | None = None  # chat: tools, tool_choice, parallel_tool_calls
    tool_parser: str | None = None  # the output is read for tool calls in this format
    structured_name: str = "structured_outputs"  # the argument that gave structured_outputs

    @property
    def params(self) -> dict:
        return self.build_kwargs["params"]

    def refusal(self, exc: ValueError) -> HttpError:
        """The engine's refusal of this request's arguments as a 400 naming OpenAI's."""
        return value_error(exc, self.max_name, self.prompt_name, self.structured_name)

    def failure(self, msg: Failed) -> HttpError:
        if msg.kind == "value":
            return self.refusal(refused(msg))
        return failure(msg, self.max_name, self.prompt_name)

    def reading_tools(self, parser: str, grammar: dict | None) -> OpenAIRequest:
        """This request with its output read for tool calls in `parser`'s format, and, for a
        forced tool choice, its calls made to follow `grammar` (structured_outputs)."""
        if grammar is None:
            return replace(self, tool_parser=parser)
        params = {**self.params, "structured_outputs": grammar}
        build = {**self.build_kwargs, "params": params}
        return replace(self, build_kwargs=build, tool_parser=parser, structured_name="tool_choice")


def parse_completion(body: CompletionRequest) -> OpenAIRequest:
    """A /v1/completions body (validated by its model) as the engine's arguments."""
    params = sampling_kwargs(body, body.max_tokens)
    structured, source = structured_outputs(dict(body))
    if structured is not None:
        params["structured_outputs"] = structured
    top_n, echo = body.logprobs, bool(body.echo)
    params["logprobs"] = top_n
    if echo and (top_n is not None or params["max_new_tokens"] == 0):
        params["prompt_logprobs"] = top_n or 0  # the echoed prompt's logprobs
    if echo and top_n is not None and body.stream:
        raise HttpError(
            400, "echo: streaming with echo and logprobs is not supported by this server", "echo"
        )
    kwargs = dict(prompt_kwargs(body.prompt), params=params)
    req = _request(body, kwargs, "max_tokens", "prompt", top_n, echo)
    return replace(req, structured_name=source)


def parse_chat(body: ChatCompletionRequest) -> OpenAIRequest:
    """A /v1/chat/completions body (validated by its model) as the engine's arguments."""
    given = body.max_completion_tokens is not None
    max_name = "max_completion_tokens" if given else "max_tokens"
    params = sampling_kwargs(body, body.max_completion_tokens if given else body.max_tokens)
    top_n = body.top_logprobs
    if top_n is not None and not body.logprobs:
        raise HttpError(
            400, "top_logprobs: logprobs must be set to true to use top_logprobs", "top_logprobs"
        )
    params["logprobs"] = (top_n or 0) if body.logprobs else None
    tools = chat_tools(dict(body))
    structured, source = structured_outputs(dict(body))
    if structured is not None:
        if tools.forced:
            raise HttpError(
                400,
                f"tool_choice: a forced tool choice takes no {source} (the calls are the output)",
                "tool_choice",
            )
        params["structured_outputs"] = structured
    messages = chat_messages(body.messages)
    kwargs = {"messages": messages, "tools": tools.template_tools(), "params": params}
    req = _request(body, kwargs, max_name, "messages", params["logprobs"], False)
    return replace(req, tools=tools, structured_name=source)


def _request(
    body: Sampling, kwargs: dict, max_name: str, prompt_name: str, top_n: int | None, echo: bool
) -> OpenAIRequest:
    opts = body.stream_options
    include = opts is not None and bool(opts.include_usage)
    continuous = include and bool(opts and opts.continuous_usage_stats)  # as vLLM: both
    stream = bool(body.stream)
    n = body.n or 1
    return OpenAIRequest(kwargs, stream, include, max_name, prompt_name, n, top_n, echo, continuous)


def sampling_kwargs(body: Sampling, max_tokens: int | None) -> dict:
    """The sampling arguments of SamplingParams.from_kwargs, with the body's defaults
    (OpenAI's; the engine checks the values again, with the model's limits)."""
    stop = body.stop
    kwargs = {
        "max_new_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        "top_k": None if body.top_k == -1 else body.top_k,  # -1: vLLM's "off"
        "stop": [] if stop is None else [stop] if isinstance(stop, str) else list(stop),
    }
    kwargs.update({name: getattr(body, name) for name in PASSED_ON})
    return kwargs


def chat_messages(value) -> list[dict]:
    """OpenAI's messages as the chat template's (runtime.serving.chat: a developer message is
    a system message, text parts are joined by newlines, tool calls and tool results kept)."""
    try:
        return chat_messages_with_tools(value)
    except ValueError as exc:
        raise HttpError(400, str(exc), "messages") from None


def prompt_kwargs(prompt: str | list) -> dict:
    """A completion's prompt (checked by its body's model: a string, strings, token ids or
    rows of token ids) as HttpClient.build's prompt= or prompt_token_ids=."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        return {"prompt_token_ids": prompt}
    return {"prompt": prompt}


def value_error(
    exc: ValueError,
    max_name: str,
    prompt_name: str,
    structured_name: str = "structured_outputs",
) -> HttpError:
    """A tandem ValueError ('name: ...') as a 400 naming the OpenAI argument: `max_name`
    gave max_new_tokens, `prompt_name` the prompt (its token ids), `structured_name`
    structured_outputs, echo prompt_logprobs. An ArgumentError carries the engine's name;
    a plain ValueError names none."""
    message = _openai_words(str(exc), max_name, prompt_name, structured_name)
    if isinstance(exc, ArgumentError):
        names = {
            "max_new_tokens": max_name,
            "prompt": prompt_name,
            "prompt_token_ids": prompt_name,
            "prompt_logprobs": "echo",
            "structured_outputs": structured_name,
        }
        param: str | None = names.get(exc.param, exc.param)
    else:
        param = None
    known = ARGUMENTS | {max_name, prompt_name, structured_name}  # this route's names
    return HttpError(400, message, param if param in known else None)


def _openai_words(message: str, max_name: str, prompt_name: str, structured_name: str) -> str:
    """The engine's message in OpenAI's names."""
    if message.startswith("structured_outputs"):
        message = structured_name + message.removeprefix("structured_outputs")
    message = message.replace("max_new_tokens", max_name).replace("prompt_token_ids", prompt_name)
    if prompt_name == "messages":
        return re.sub(r"^prompt\b", "messages", message)
    if message.startswith("prompt_logprobs"):  # asked for by echo (parse_completion)
        return "echo: the prompt's logprobs" + message.removeprefix("prompt_logprobs")
    return message


def refused(msg: Failed) -> ValueError:
    """The server's refusal (a Failed reply of kind "value") as the error it raised: an
    ArgumentError when it named the argument."""
    if msg.param is not None:
        return ArgumentError(msg.message, msg.param)
    return ValueError(msg.message)


def failure(msg: Failed, max_name: str, prompt_name: str) -> HttpError:
    """The server's Failed reply to a request: 503 when the engine died, drains (with
    Retry-After) or cancelled it, else (the server refused its arguments) a 400 naming the
    OpenAI argument."""
    if msg.kind == "dead":
        return engine_unavailable(msg.message)
    if msg.kind == "draining":
        return server_draining(msg.message)
    if msg.kind == "cancelled":
        return HttpError(
            503,
            f"the request was cancelled: {msg.message}",
            kind="server_error",
            code="request_cancelled",
        )
    return value_error(refused(msg), max_name, prompt_name)
