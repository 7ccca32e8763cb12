import math

import pytest

from runtime.params import SamplingParams, check_prompt_ids

pytestmark = pytest.mark.timeout(30)


def test_defaults_are_greedy():
    p = SamplingParams.from_kwargs()
    assert p.greedy and p.top_k is None and p.top_p == 1.0


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -3}, "seed"),
        ({"stop": [1]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams.from_kwargs(**kwargs)


def test_prompt_ids_checked_against_vocab():
    assert check_prompt_ids([0, 5], 6) == [0, 5]
    for bad in ([], [6], [-1], [True], "12"):
        with pytest.raises(ValueError, match="prompt_token_ids"):
            check_prompt_ids(bad, 6)


@pytest.mark.parametrize("stop", [5, [1], ["a", None], {"a": 1}])
def test_bad_stop_says_what_is_accepted(stop):
    # one string is accepted as well as a list: the message must not say "a list" alone
    with pytest.raises(ValueError, match=r"^stop: expected a string or a list of strings, got "):
        SamplingParams.from_kwargs(stop=stop)


@pytest.mark.parametrize("stop", ["x", ["x", "y"], ("x",), []])
def test_stop_takes_a_string_or_a_list(stop):
    expected = (stop,) if isinstance(stop, str) else tuple(stop)
    assert SamplingParams.from_kwargs(stop=stop).stop == expected


def test_python_api_keeps_temperatures_above_openais_range():
    # OpenAI's [0, 2] is the HTTP front's rule (runtime/api/openai/bodies.py); the Python API takes
    # any finite temperature >= 0
    assert SamplingParams.from_kwargs(temperature=2.5).temperature == 2.5
