"""The OpenAI and vLLM request arguments of the HTTP front without a server
(runtime.api.openai.requests): which are accepted, what they become as the engine's
arguments (runtime.params.SamplingParams), and the 400s that name the OpenAI argument,
whether the front or the engine refuses it."""

from __future__ import annotations

import pytest

from runtime.api.openai.bodies import ChatCompletionRequest, CompletionRequest
from runtime.api.openai.errors import HttpError
from runtime.api.openai.requests import parse_chat, parse_completion, value_error
from runtime.api.openai.structured import structured_outputs
from runtime.control import protocol
from runtime.control.protocol import Failed
from runtime.errors import ArgumentError
from runtime.params import SamplingParams, check_fits
from tests.http_bodies import validated

pytestmark = pytest.mark.timeout(30)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def _completion(**body):
    return parse_completion(validated(CompletionRequest, {**COMPLETION, **body}))


def _chat(**body):
    return parse_chat(validated(ChatCompletionRequest, {**CHAT, **body}))


def _refused(parse, **body) -> HttpError:
    """The 400 for `body`: the front's own, or the engine's ValueError as the front turns it
    (SamplingParams checks what HttpClient.build sends)."""
    try:
        req = parse(**body)
        SamplingParams.from_kwargs(**req.params)
    except HttpError as exc:
        assert exc.status == 400, exc.body()
        return exc
    except ValueError as exc:
        return req.refusal(exc)
    raise AssertionError(f"{body} was accepted")


def test_completion_logprobs_and_echo_become_engine_arguments():
    req = _completion(logprobs=3)
    assert req.params["logprobs"] == 3 and "prompt_logprobs" not in req.params
    assert req.logprobs == 3 and not req.echo
    req = _completion(logprobs=1, echo=True, max_tokens=1, temperature=0)
    assert req.params["prompt_logprobs"] == 1 and req.params["logprobs"] == 1 and req.echo
    # lm-evaluation-harness: token-id rows, echo, max_tokens 0
    req = _completion(prompt=[[1, 2, 3], [4, 5]], echo=True, logprobs=1, max_tokens=0)
    assert req.build_kwargs["prompt_token_ids"] == [[1, 2, 3], [4, 5]]
    assert req.params["max_new_tokens"] == 0 and req.params["prompt_logprobs"] == 1
    SamplingParams.from_kwargs(**req.params)  # max_new_tokens=0 is fine with prompt_logprobs
    req = _completion(echo=True, max_tokens=0)  # echo alone: the engine still needs prompt_logprobs
    assert req.params["prompt_logprobs"] == 0 and req.logprobs is None
    assert "prompt_logprobs" not in _completion(echo=True).params


def test_chat_logprobs_and_top_logprobs():
    assert _chat(logprobs=True).params["logprobs"] == 0
    req = _chat(logprobs=True, top_logprobs=5)
    assert req.params["logprobs"] == 5 and req.logprobs == 5
    assert _chat(logprobs=False).params["logprobs"] is None
    assert _chat().logprobs is None


def test_passed_on_arguments_reach_sampling_params():
    body = dict(
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"7": -100, "9": 2.5},
        n=3,
        seed=4,
        ignore_eos=True,
        min_tokens=2,
        repetition_penalty=1.2,
        min_p=0.1,
        stop_token_ids=[3],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        top_k=5,
    )
    for parse in (_completion, _chat):
        req = parse(**body)
        params = SamplingParams.from_kwargs(**req.params)
        assert params.logit_bias == ((7, -100.0), (9, 2.5)) and params.n == 3 == req.n
        assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
        assert params.ignore_eos and params.min_tokens == 2 and params.stop_token_ids == (3,)
        assert (params.repetition_penalty, params.min_p, params.top_k) == (1.2, 0.1, 5)
        assert params.include_stop_str_in_output and not params.skip_special_tokens


def test_stream_options():
    req = _completion(stream=True, stream_options={"include_usage": True})
    assert req.include_usage and not req.continuous_usage
    opts = {"include_usage": True, "continuous_usage_stats": True}
    assert _chat(stream=True, stream_options=opts).continuous_usage
    # as vLLM: continuous usage stats only with include_usage
    assert not _chat(stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage
    error = _refused(_completion, stream=True, stream_options={"bogus": 1})
    assert error.param == "stream_options"


@pytest.mark.parametrize(
    "parse,body,param",
    [
        (_completion, {"logprobs": 21}, "logprobs"),
        (_completion, {"logprobs": -1}, "logprobs"),
        (_completion, {"logprobs": True}, "logprobs"),
        (_completion, {"echo": "yes"}, "echo"),
        (_completion, {"echo": True, "logprobs": 2, "stream": True}, "echo"),
        (_completion, {"max_tokens": 0}, "max_tokens"),  # without echo
        (_completion, {"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        (_completion, {"best_of": 2}, "best_of"),
        (_completion, {"suffix": "x"}, "suffix"),
        (_completion, {"presence_penalty": 2.5}, "presence_penalty"),
        (_completion, {"frequency_penalty": -3}, "frequency_penalty"),
        (_completion, {"logit_bias": {"x": 1}}, "logit_bias"),
        (_completion, {"logit_bias": {"5": 101}}, "logit_bias"),
        (_completion, {"logit_bias": [1, 2]}, "logit_bias"),
        (_completion, {"n": 0}, "n"),
        (_completion, {"n": True}, "n"),
        (_completion, {"repetition_penalty": 0}, "repetition_penalty"),
        (_completion, {"min_p": 1.5}, "min_p"),
        (_completion, {"ignore_eos": "no"}, "ignore_eos"),
        (_completion, {"stop_token_ids": [-1]}, "stop_token_ids"),
        (_completion, {"top_logprobs": 2}, "top_logprobs"),  # a chat argument
        (_chat, {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        (_chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (_chat, {"logprobs": 3}, "logprobs"),
        (_chat, {"echo": True}, "echo"),
        (_chat, {"tools": [{"type": "function"}]}, "tools"),
        (_chat, {"response_format": {"type": "xml"}}, "response_format"),
        (_chat, {"functions": [{"name": "f"}]}, "functions"),  # legacy: refused, as vLLM
        (_chat, {"max_completion_tokens": 2, "min_tokens": 3}, "min_tokens"),
        (_chat, {"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_bad_arguments_are_400_naming_them(parse, body, param):
    error = _refused(parse, **body)
    assert error.param == param, error.body()
    assert param in error.message, error.message
    assert "max_new_tokens" not in error.message, error.message


def test_min_tokens_message_uses_openais_name():
    error = _refused(_completion, min_tokens=5, max_tokens=4)
    assert "max_tokens (4)" in error.message, error.message


@pytest.mark.parametrize(
    "message,engine,param",
    [
        ("n: 17 is more than the 16 samples a request may ask for", "n", "n"),
        ("logit_bias: token id 60000 is outside the vocabulary [0, 49152)", "logit_bias", None),
        ("logit_bias[5]: expected a number in [-100, 100], got 101", "logit_bias", None),
        ("prompt_logprobs: not supported by this server yet", "prompt_logprobs", "echo"),
        ("max_new_tokens: expected an integer >= 1, got 0", "max_new_tokens", "max_tokens"),
        ("prompt_token_ids: token id 99 is outside the vocabulary", "prompt_token_ids", "prompt"),
    ],
)
def test_engine_refusals_name_the_openai_argument(message, engine, param):
    param = param or engine
    error = value_error(ArgumentError(message, engine), "max_tokens", "prompt")
    assert error.status == 400 and error.param == param, error.body()
    assert error.message.startswith(param), error.message
    # the server's refusal carries the argument across the wire
    reply = protocol.decode(protocol.encode(Failed("r", message, "value", engine)))
    assert _completion().failure(reply).param == param


def test_the_argument_named_is_the_errors_not_its_words():
    refusal = ArgumentError("the schema cannot be compiled", "structured_outputs")
    assert _completion(response_format={"type": "json_object"}).refusal(refusal).param == (
        "response_format"
    )
    assert _completion().refusal(ArgumentError("n: too many", "bogus")).param is None
    with pytest.raises(ArgumentError) as caught:
        SamplingParams.from_kwargs(logit_bias={"5": 101})
    assert caught.value.param == "logit_bias" and str(caught.value).startswith("logit_bias[5]")
    with pytest.raises(ArgumentError) as caught:
        check_fits(10, 8, 16, "prompt_token_ids")
    assert caught.value.param == "max_new_tokens"


def test_supported_arguments_are_no_longer_refused():
    body = dict(
        logprobs=2,
        echo=True,
        presence_penalty=1,
        frequency_penalty=1,
        logit_bias={"1": 1},
        n=2,
        best_of=1,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    validated(CompletionRequest, {**COMPLETION, **body})
    chat = dict(body, logprobs=True, top_logprobs=2)
    del chat["echo"], chat["best_of"]  # completions' arguments
    validated(ChatCompletionRequest, {**CHAT, **chat})


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    "value,expected",
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"json": {"type": "object"}}),
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}, {"json": SCHEMA}),
        ({"type": "json_schema", "json_schema": {"name": "p"}}, {"json": {"type": "object"}}),
    ],
)
def test_response_format_as_the_engines_structured_outputs(value, expected):
    assert structured_outputs({"response_format": value}) == (expected, "response_format")


@pytest.mark.parametrize(
    "value",
    [
        "json",
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": "x"},
        {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
        {"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}},
        {"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "strict": "yes"}},
        {"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "shema": {}}},
        {"type": "json_object", "extra": 1},
        {"type": "text", "json_schema": {"name": "p"}},
    ],
)
def test_bad_response_formats_are_400s_naming_it(value):
    with pytest.raises(HttpError) as info:
        structured_outputs({"response_format": value})
    assert info.value.status == 400 and info.value.param == "response_format"
    assert info.value.message.startswith("response_format: ")
