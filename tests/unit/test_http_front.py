"""The OpenAI-compatible HTTP front's request rules without a server (runtime.api.openai.bodies,
openai.requests, http.routes): OpenAI's temperature range, what `stop` accepts, which model names
it serves."""

from __future__ import annotations

import asyncio
import math

import pytest

from runtime.api.http.routes import Routes
from runtime.api.openai.bodies import CompletionRequest
from runtime.api.openai.errors import HttpError
from runtime.api.openai.requests import sampling_kwargs, value_error
from runtime.params import SamplingParams
from tests.http_bodies import validated

pytestmark = pytest.mark.timeout(30)


def _kwargs(body: dict) -> dict:
    """The sampling arguments of a completion body with `body`'s."""
    req = validated(CompletionRequest, {"model": "m", "prompt": "x", **body})
    return sampling_kwargs(req, req.max_tokens)


def _refusal(body: dict) -> HttpError:
    """The 400 that the front answers for `body`'s sampling arguments (refused by the body's
    model, or by SamplingParams as HttpClient.build does, its ValueError turned into
    HttpError)."""
    try:
        SamplingParams.from_kwargs(**_kwargs(body))
    except HttpError as exc:
        return exc
    except ValueError as exc:
        return value_error(exc, "max_tokens", "prompt")
    raise AssertionError(f"{body} was accepted")


@pytest.mark.parametrize("temperature", [2.01, 3, 100.0, math.inf, -0.5, math.nan])
def test_temperature_outside_openais_range_is_400(temperature):
    error = _refusal({"temperature": temperature})
    assert error.status == 400 and error.param == "temperature", error.body()
    assert error.message.startswith("temperature: ") and "[0, 2]" in error.message


@pytest.mark.parametrize("temperature", [0, 0.0, 0.7, 1, 2, 2.0])
def test_temperature_in_openais_range_is_passed_on(temperature):
    assert _kwargs({"temperature": temperature})["temperature"] == temperature


def test_temperature_defaults_to_openais():
    assert _kwargs({})["temperature"] == 1.0


def test_non_number_temperature_is_400():
    error = _refusal({"temperature": "hot"})
    assert error.status == 400 and error.param == "temperature", error.body()


@pytest.mark.parametrize("stop", [5, [1], {"x": 1}])
def test_bad_stop_says_a_string_or_a_list_is_accepted(stop):
    error = _refusal({"stop": stop})
    assert error.status == 400 and error.param == "stop", error.body()
    assert "a string or a list of strings" in error.message, error.message


@pytest.mark.parametrize("stop, expected", [("x", ("x",)), (["x", "y"], ("x", "y"))])
def test_stop_takes_a_string_or_a_list(stop, expected):
    assert SamplingParams.from_kwargs(**_kwargs({"stop": stop})).stop == expected


# --- the served model name -----------------------------------------------------------------
class _FakeClient:
    """What Routes reads of its HttpClient: the server's info, already fetched."""

    def __init__(self, model: str):
        self._info = {"model": model}


def _check(routes: Routes, name: str):
    return asyncio.run(routes.check_model(name))


def test_default_served_name_is_the_targets_file_name_or_its_path():
    path = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    routes = Routes(_FakeClient(path), None)
    assert _check(routes, "SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert _check(routes, path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(HttpError) as info:
        _check(routes, "target")
    assert info.value.status == 404 and "SmolLM2-135M-Instruct.Q4_1.gguf" in info.value.message


def test_default_served_name_of_a_checkpoint_directory():
    routes = Routes(_FakeClient("/models/llama-8b/"), None)
    assert _check(routes, "llama-8b") == "llama-8b"


def test_served_model_name_is_the_only_name():
    routes = Routes(_FakeClient("/models/llama-8b"), "tandem")
    assert _check(routes, "tandem") == "tandem"
    for other in ("llama-8b", "/models/llama-8b"):
        with pytest.raises(HttpError) as info:
            _check(routes, other)
        assert info.value.status == 404
