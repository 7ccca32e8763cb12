import math

import pytest

from runtime.params import SamplingParams, check_prompt_ids

pytestmark = pytest.mark.timeout(30)


def test_defaults_are_greedy():
    p = SamplingParams.from_kwargs()
    assert p.greedy and p.top_k is None and p.top_p == 1.0


@pytest.mark.parametrize("kwargs,name", [
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
])
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams.from_kwargs(**kwargs)


def test_prompt_ids_checked_against_vocab():
    assert check_prompt_ids([0, 5], 6) == [0, 5]
    for bad in ([], [6], [-1], [True], "12"):
        with pytest.raises(ValueError, match="prompt_token_ids"):
            check_prompt_ids(bad, 6)
