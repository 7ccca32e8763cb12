"""OpenAI's and vLLM's sampling arguments through the HTTP front (`tandem serve --http`),
driven by the official `openai` client and compared with the ZeroMQ Client's Python API on
the same server: logprobs (completions' legacy shape, chat's content list), n with a seed,
penalties and logit_bias, echo, and the 400s that name the argument. One server for the
module."""

from __future__ import annotations

import openai
import pytest

from runtime import Client
from tests import launch

pytestmark = pytest.mark.timeout(240)

MODEL = "target"  # the served model id: the target checkpoint's directory name
# two runs of one request may verify its tokens in other batch shapes: float32 noise
TOL = 1e-4


@pytest.fixture(scope="module")
def served(tokenized_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    cfg = launch.write_config(root / "c.yaml", *tokenized_pair, max_seq_len=160)
    address = f"ipc://{root}/server.sock"
    port = launch.free_port()
    log_path = root / "serve.log"
    proc = launch.start_serve(cfg, address, "--http", f"127.0.0.1:{port}", log_path=log_path)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        launch.wait_http(url, proc, log_path)
        zmq_client = Client(address)
        oai = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        yield {"client": zmq_client, "oai": oai}
        zmq_client.close()
        oai.close()
    finally:
        assert launch.stop(proc) == 0, open(log_path).read()[-4000:]
        launch.assert_group_gone(proc.pid)


@pytest.fixture(scope="module")
def tokenizer(tokenized_pair):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tokenized_pair[1])


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _legacy(tokenizer, token_ids: list[int], logprobs: list[dict[int, float] | None]) -> dict:
    """The legacy logprobs object that the Python API's output should give."""
    tops: list[dict[str, float] | None] = []
    for entry in logprobs:
        top: dict[str, float] = {}
        for token, lp in (entry or {}).items():
            top.setdefault(_text(tokenizer, token), lp)
        tops.append(None if entry is None else top)
    tokens = [_text(tokenizer, t) for t in token_ids]
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e[t] for t, e in zip(token_ids, logprobs)],
        "top_logprobs": tops,
        "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))],
    }


def _assert_close(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=TOL)
    for top, expected in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
        assert top == (None if expected is None else pytest.approx(expected, abs=TOL))


def test_completion_logprobs_equal_the_python_apis(served, tokenizer):
    prompt = "Once upon a time"
    ref = served["client"].generate(prompt, max_new_tokens=10, temperature=0, logprobs=3)
    out = served["oai"].completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=3
    )
    got = out.choices[0].logprobs.model_dump()
    assert out.choices[0].text == ref.text
    _assert_close(got, _legacy(tokenizer, ref.token_ids, ref.logprobs))
    assert all(3 <= len(top) <= 4 for top in got["top_logprobs"])
    chunks = served["oai"].completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=3, stream=True
    )
    streamed: dict[str, list] = {k: [] for k in got}
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key, values in chunk.choices[0].logprobs.model_dump().items():
                streamed[key] += values
    assert streamed == got


def test_chat_logprobs_and_top_logprobs(served, tokenizer):
    text = "Tell me a story."
    ref = served["client"].generate(text, chat=True, max_new_tokens=8, temperature=0, logprobs=2)
    out = served["oai"].chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert out.choices[0].message.content == ref.text and len(content) == len(ref.token_ids)
    for item, token, entry in zip(content, ref.token_ids, ref.logprobs):
        assert item.token == _text(tokenizer, token)
        assert item.logprob == pytest.approx(entry[token], abs=TOL)
        assert item.bytes == list(item.token.encode())
        best = sorted(entry.values(), reverse=True)[:2]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(best, abs=TOL)
        assert item.top_logprobs[0].logprob >= item.logprob  # greedy: the chosen is the best


def test_n_with_seed_is_reproducible(served):
    args = dict(model=MODEL, prompt="Sampling:", max_tokens=12, temperature=1.0, n=3, seed=11)
    first = served["oai"].completions.create(**args)
    again = served["oai"].completions.create(**args)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in again.choices] == texts and len(set(texts)) > 1
    refs = served["client"].generate("Sampling:", max_new_tokens=12, temperature=1.0, n=3, seed=11)
    assert [r.text for r in refs] == texts
    assert first.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    assert first.usage.prompt_tokens == refs[0].stats["prompt_tokens"]  # once, not n times


def test_penalties_and_logit_bias(served):
    args = dict(model=MODEL, prompt="Numbers:", temperature=0)
    greedy = served["client"].generate("Numbers:", max_new_tokens=1, temperature=0).token_ids[0]
    out = served["oai"].completions.create(**args, max_tokens=1, logit_bias={str(greedy): -100})
    banned = served["client"].generate(
        "Numbers:", max_new_tokens=1, temperature=0, logit_bias={greedy: -100}
    )
    assert banned.token_ids[0] != greedy and out.choices[0].text == banned.text
    kwargs = dict(presence_penalty=1.5, frequency_penalty=0.5)
    out = served["oai"].completions.create(
        **args, max_tokens=16, **kwargs, extra_body={"repetition_penalty": 1.3, "min_tokens": 4}
    )
    ref = served["client"].generate(
        "Numbers:", max_new_tokens=16, temperature=0, repetition_penalty=1.3, min_tokens=4, **kwargs
    )
    assert out.choices[0].text == ref.text


def test_echo_with_logprobs_of_token_id_prompts(served, tokenizer):
    """lm-evaluation-harness's loglikelihood requests: token-id rows, echo, logprobs=1,
    max_tokens 1 or 0; the prompt's logprobs are the Python API's prompt_logprobs."""
    rows = [[1, 40, 41, 42], [1, 77, 3]]
    args = dict(model=MODEL, prompt=rows, echo=True, logprobs=1, temperature=0)
    out = served["oai"].completions.create(**args, max_tokens=1)
    refs = served["client"].generate(
        prompt_token_ids=rows, max_new_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1
    )
    for row, ref, choice in zip(rows, refs, out.choices, strict=True):
        want = _legacy(tokenizer, row + ref.token_ids, ref.prompt_logprobs + ref.logprobs)
        _assert_close(choice.logprobs.model_dump(), want)
        assert want["token_logprobs"][0] is None and want["top_logprobs"][0] is None
        assert choice.text == tokenizer.decode(row, skip_special_tokens=True) + ref.text
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 2
    zero = served["oai"].completions.create(**args, max_tokens=0)
    assert [c.logprobs.tokens for c in zero.choices] == [
        c.logprobs.tokens[:-1] for c in out.choices
    ]
    assert zero.usage.completion_tokens == 0 and zero.usage.prompt_tokens == 7


@pytest.mark.parametrize(
    "kind,kwargs,param",
    [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logit_bias": {"x": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"5": 200}}, "logit_bias"),
        ("completions", {"presence_penalty": 3}, "presence_penalty"),
        ("completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
        ("completions", {"n": 17}, "n"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"extra_body": {"min_tokens": 9}}, "min_tokens"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"n": 17}, "n"),
    ],
)
def test_bad_arguments_are_400_and_serving_goes_on(served, kind, kwargs, param):
    oai = served["oai"]
    if kind == "chat":
        create, args = oai.chat.completions.create, {"messages": [{"role": "user", "content": "x"}]}
    else:
        create, args = oai.completions.create, {"prompt": "x"}
    with pytest.raises(openai.BadRequestError) as info:
        create(model=MODEL, max_tokens=4, **args, **kwargs)
    error = info.value.body if "message" in info.value.body else info.value.body["error"]
    assert info.value.status_code == 400 and error["param"] == param, error
    assert param in error["message"] and "max_new_tokens" not in error["message"], error
    assert create(model=MODEL, max_tokens=2, temperature=0, **args).choices
