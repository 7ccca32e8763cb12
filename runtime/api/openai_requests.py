"""OpenAI request bodies as the engine's arguments: which arguments /v1/completions and
/v1/chat/completions accept (OpenAI's, and vLLM's extensions), their checks and OpenAI's
defaults, the prompt or messages and the sampling arguments (runtime.params.SamplingParams'
keywords) they give: completions' logprobs=N and echo become logprobs / prompt_logprobs,
chat's logprobs + top_logprobs become logprobs; and the engine's refusals turned into 400s
that name the OpenAI argument. A chat's tools, tool_choice, response_format and vLLM's
structured_outputs: runtime/api/openai_structured.py. Nothing here talks to the server.
docs/sampling.md has the table of every argument."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from runtime.api.openai_errors import HttpError, engine_unavailable, server_draining
from runtime.api.openai_structured import chat_tools, structured_outputs
from runtime.api.tool_calls_request import ToolRequest
from runtime.control.protocol import Failed
from runtime.params import MAX_LOGPROBS
from runtime.serving.chat import chat_messages_with_tools

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; used for chat as well
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default (the Python API's default is greedy)
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2] (the Python API takes any finite T >= 0)

# Arguments accepted only with their "off" value (anything else is a 400 naming them).
OFF_VALUES: dict[str, tuple] = {
    "best_of": (None, 1),  # vLLM refuses it too
    "suffix": (None, ""),
    "functions": (None, []),  # OpenAI's legacy functions: refused, as vLLM does
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "prediction": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
}
CHAT_OFF_VALUES = {**OFF_VALUES, "echo": (None, False)}  # vLLM's chat echo: not here
_IGNORED = {
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "reasoning_effort",
    "prompt_cache_key",
    "safety_identifier",
    "verbosity",
}
# SamplingParams' arguments passed on as they come (the engine checks them; vLLM's names)
PASSED_ON = (
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
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "response_format",
    "structured_outputs",  # vLLM's extension
    *PASSED_ON,
}
_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats", "include_obfuscation")
COMPLETION_ARGS = _COMMON | {"prompt", "echo"} | set(OFF_VALUES) | _IGNORED
CHAT_ARGS = (
    _COMMON
    | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
    | set(CHAT_OFF_VALUES)
    | _IGNORED
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
        return value_error(self._renamed(str(exc)), self.max_name, self.prompt_name)

    def failure(self, msg: Failed) -> HttpError:
        if msg.kind == "value":
            return self.refusal(ValueError(msg.message))
        return failure(msg, self.max_name, self.prompt_name)

    def reading_tools(self, parser: str, grammar: dict | None) -> OpenAIRequest:
        """This request with its output read for tool calls in `parser`'s format, and, for a
        forced tool choice, its calls made to follow `grammar` (structured_outputs)."""
        if grammar is None:
            return replace(self, tool_parser=parser)
        params = {**self.params, "structured_outputs": grammar}
        build = {**self.build_kwargs, "params": params}
        return replace(self, build_kwargs=build, tool_parser=parser, structured_name="tool_choice")

    def _renamed(self, message: str) -> ValueError:
        """The engine's refusal of structured_outputs, naming the argument that gave it."""
        if message.startswith("structured_outputs"):
            message = self.structured_name + message.removeprefix("structured_outputs")
        return ValueError(message)


def parse_completion(body: dict) -> OpenAIRequest:
    """A /v1/completions body (its arguments already passed check_args)."""
    if "prompt" not in body:
        raise HttpError(400, "prompt: this argument is required", "prompt")
    params = sampling_kwargs(body, "max_tokens")
    structured, source = structured_outputs(body)
    if structured is not None:
        params["structured_outputs"] = structured
    echo = _flag(body, "echo")
    top_n = _top_n(body, "logprobs")
    params["logprobs"] = top_n
    if echo and (top_n is not None or params["max_new_tokens"] == 0):
        params["prompt_logprobs"] = top_n or 0  # the echoed prompt's logprobs
    stream = bool(body.get("stream"))
    if echo and top_n is not None and stream:
        raise HttpError(
            400, "echo: streaming with echo and logprobs is not supported by this server", "echo"
        )
    kwargs = dict(prompt_kwargs(body["prompt"]), params=params)
    req = _request(body, kwargs, "max_tokens", "prompt", top_n, echo)
    return replace(req, structured_name=source)


def parse_chat(body: dict) -> OpenAIRequest:
    """A /v1/chat/completions body (its arguments already passed check_args)."""
    max_name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    params = sampling_kwargs(body, max_name)
    wanted = _flag(body, "logprobs")
    top_n = _top_n(body, "top_logprobs")
    if top_n is not None and not wanted:
        raise HttpError(
            400, "top_logprobs: logprobs must be set to true to use top_logprobs", "top_logprobs"
        )
    params["logprobs"] = (top_n or 0) if wanted else None
    tools = chat_tools(body)
    structured, source = structured_outputs(body)
    if structured is not None:
        if tools.forced:
            raise HttpError(
                400,
                f"tool_choice: a forced tool choice takes no {source} (the calls are the output)",
                "tool_choice",
            )
        params["structured_outputs"] = structured
    messages = chat_messages(body.get("messages"))
    kwargs = {"messages": messages, "tools": tools.template_tools(), "params": params}
    req = _request(body, kwargs, max_name, "messages", params["logprobs"], False)
    return replace(req, tools=tools, structured_name=source)


def _request(
    body: dict, kwargs: dict, max_name: str, prompt_name: str, top_n: int | None, echo: bool
) -> OpenAIRequest:
    opts = body.get("stream_options") or {}
    include = bool(opts.get("include_usage"))
    continuous = include and bool(opts.get("continuous_usage_stats"))  # as vLLM: both
    n = kwargs["params"].get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    stream = bool(body.get("stream"))
    return OpenAIRequest(kwargs, stream, include, max_name, prompt_name, n, top_n, echo, continuous)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise HttpError(400, f"{name}: expected true or false, got {value!r}", name)
    return bool(value)


def _top_n(body: dict, name: str) -> int | None:
    """A count of top alternatives per token (completions' logprobs, chat's top_logprobs)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise HttpError(
            400, f"{name}: expected an integer in [0, {MAX_LOGPROBS}], got {value!r}", name
        )
    return value


def check_args(body: dict, allowed: set[str], off: dict[str, tuple] = OFF_VALUES) -> None:
    """Unknown arguments, unsupported values of the ones accepted only "off" (`off`), stream
    and stream_options: a 400 naming the argument."""
    for name in body:
        if name not in allowed:
            raise HttpError(400, f"Unrecognized request argument supplied: {name}", name)
    for name, values in off.items():
        value = body.get(name)
        if value is not None and value not in values:
            raise HttpError(400, f"{name}: {value!r} is not supported by this server", name)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise HttpError(400, "stream: expected a boolean", "stream")
    opts = body.get("stream_options")
    if opts is not None and (
        not isinstance(opts, dict) or not all(k in _STREAM_OPTIONS for k in opts)
    ):
        raise HttpError(
            400,
            'stream_options: expected {"include_usage": bool, "continuous_usage_stats": bool}',
            "stream_options",
        )


def sampling_kwargs(body: dict, max_name: str) -> dict:
    """The sampling arguments of SamplingParams.from_kwargs, with OpenAI's defaults (the
    values' own checks are SamplingParams'; only OpenAI's temperature range is checked here)."""
    max_tokens = body.get(max_name)
    top_k = body.get("top_k")
    if top_k == -1 and not isinstance(top_k, bool):  # vLLM's "off"
        top_k = None
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    temperature = body.get("temperature")
    if temperature is None:
        temperature = DEFAULT_TEMPERATURE
    elif _is_number(temperature) and not 0 <= temperature <= MAX_TEMPERATURE:
        raise HttpError(
            400,
            f"temperature: expected a number in [0, {MAX_TEMPERATURE:g}], got {temperature!r}",
            "temperature",
        )
    kwargs = {
        "max_new_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        "temperature": temperature,
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
        "top_k": top_k,
        "seed": body.get("seed"),
        "stop": stop,
    }
    kwargs.update({name: body.get(name) for name in PASSED_ON})
    return kwargs


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def chat_messages(value) -> list[dict]:
    """OpenAI's messages as the chat template's (runtime.serving.chat: a developer message is
    a system message, text parts are joined by newlines, tool calls and tool results kept)."""
    try:
        return chat_messages_with_tools(value)
    except ValueError as exc:
        raise HttpError(400, str(exc), "messages") from None


def prompt_kwargs(prompt) -> dict:
    """A completion's prompt as HttpClient.build's prompt= or prompt_token_ids=."""

    def is_int(t):
        return isinstance(t, int) and not isinstance(t, bool)

    if isinstance(prompt, list) and prompt:
        if all(is_int(t) for t in prompt):
            return {"prompt_token_ids": prompt}
        if all(isinstance(row, list) for row in prompt):
            return {"prompt_token_ids": prompt}
    if isinstance(prompt, (str, list)):
        return {"prompt": prompt}
    raise HttpError(
        400,
        "prompt: expected a string, a list of strings, a list of token ids or a list of such lists",
        "prompt",
    )


def value_error(exc: ValueError, max_name: str, prompt_name: str) -> HttpError:
    """A tandem ValueError ('name: ...') as a 400 naming the OpenAI argument."""
    message = str(exc).replace("max_new_tokens", max_name).replace("prompt_token_ids", prompt_name)
    if prompt_name == "messages":
        message = re.sub(r"^prompt\b", "messages", message)
    elif message.startswith("prompt_logprobs"):  # asked for by echo (parse_completion)
        message = "echo: the prompt's logprobs" + message.removeprefix("prompt_logprobs")
    match = re.match(r"([A-Za-z_]+)[:\s\[]", message)
    param = match.group(1) if match else None
    if param and param not in CHAT_ARGS | COMPLETION_ARGS:
        param = None
    return HttpError(400, message, param)


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
    return value_error(ValueError(msg.message), max_name, prompt_name)
