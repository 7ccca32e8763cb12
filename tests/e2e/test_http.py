"""The OpenAI-compatible HTTP front (`tandem serve CONFIG --http HOST:PORT`), driven by the
official `openai` client and compared with the ZeroMQ Client on the same server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from runtime import Client
from tests import checkpoints, launch

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(240)

MODEL = "target"  # the served model id: the target checkpoint's directory name


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    target = checkpoints.build_with_tokenizer(root / MODEL, seed=0)
    draft = checkpoints.build_near_draft(target, root / "draft", noise=0.05)
    return draft, target


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    cfg = launch.write_config(root / "c.yaml", *models, max_seq_len=160)
    address = f"ipc://{root}/server.sock"
    port = launch.free_port()
    log_path = root / "serve.log"
    proc = launch.start_serve(cfg, address, "--http", f"127.0.0.1:{port}", log_path=log_path)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        launch.wait_http(url, proc, log_path)
        zmq_client = Client(address)
        oai = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        yield {
            "proc": proc,
            "url": url,
            "address": address,
            "client": zmq_client,
            "oai": oai,
            "log": log_path,
        }
        zmq_client.close()
        oai.close()
    finally:
        if proc.poll() is None:
            launch.stop(proc)
        launch.assert_group_gone(proc.pid)


@pytest.fixture(scope="module")
def tokenizer(models):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(models[1])


def test_models_lists_the_target(served):
    models = served["oai"].models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert served["oai"].models.retrieve(MODEL).id == MODEL


def test_completion_equals_zmq_client(served, tokenizer):
    prompt = "Once upon a time"
    ref = served["client"].generate(prompt, max_new_tokens=20, temperature=0)
    out = served["oai"].completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason == "length"
    assert out.usage.completion_tokens == len(ref.token_ids) == 20
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert out.usage.total_tokens == out.usage.prompt_tokens + 20


def test_completion_token_ids_and_batch(served):
    ids = [[5, 6, 7, 8], [9, 10]]
    refs = served["client"].generate(prompt_token_ids=ids, max_new_tokens=8, temperature=0)
    out = served["oai"].completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert out.usage.prompt_tokens == 6 and out.usage.completion_tokens == 16
    texts = served["oai"].completions.create(
        model=MODEL, prompt=["a b", "c d e"], max_tokens=5, temperature=0
    )
    assert [c.text for c in texts.choices] == [
        r.text for r in served["client"].generate(["a b", "c d e"], max_new_tokens=5, temperature=0)
    ]


def test_streamed_completion_concatenates(served):
    prompt = "The weather today"
    full = served["oai"].completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0
    )
    chunks = list(
        served["oai"].completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert sum(1 for t in texts if t) > 1
    assert "".join(texts) == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_equals_zmq_client_chat(served):
    text = "Tell me a story."
    ref = served["client"].generate(text, chat=True, max_new_tokens=16, temperature=0)
    out = served["oai"].chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=16, temperature=0
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == len(ref.token_ids)
    chunks = list(
        served["oai"].chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": text}],
            max_tokens=16,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    assert sum(1 for p in pieces if p) > 1
    assert "".join(pieces) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_multi_turn_chat_uses_the_whole_conversation(served, models, tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Count to three."},
    ]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    want = checkpoints.hf_greedy(models[1], list(ids), 12)
    out = served["oai"].chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=12, temperature=0
    )
    assert out.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(ids)
    # text parts are joined; the same conversation through the ZeroMQ token-id path agrees
    parts = [dict(m, content=[{"type": "text", "text": m["content"]}]) for m in messages]
    again = served["oai"].chat.completions.create(
        model=MODEL, messages=parts, max_tokens=12, temperature=0
    )
    assert again.choices[0].message.content == out.choices[0].message.content
    ref = served["client"].generate(prompt_token_ids=list(ids), max_new_tokens=12, temperature=0)
    assert ref.token_ids == want


def test_sampling_params_and_stop_match_zmq_client(served):
    kwargs = dict(max_new_tokens=20, temperature=0.8, top_p=0.9, top_k=20, seed=7)
    ref = served["client"].generate("Sampling:", **kwargs)
    out = served["oai"].completions.create(
        model=MODEL,
        prompt="Sampling:",
        max_tokens=20,
        temperature=0.8,
        top_p=0.9,
        seed=7,
        extra_body={"top_k": 20},
    )
    assert out.choices[0].text == ref.text
    full = served["client"].generate("Numbers:", max_new_tokens=30, temperature=0).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    out = served["oai"].completions.create(
        model=MODEL, prompt="Numbers:", max_tokens=30, temperature=0, stop=stop
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[: full.find(stop)]
    streamed = "".join(
        c.choices[0].text
        for c in served["oai"].completions.create(
            model=MODEL, prompt="Numbers:", max_tokens=30, temperature=0, stop=[stop], stream=True
        )
    )
    assert streamed == out.choices[0].text


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"n": 17}, "n"),  # more samples than the server's cap (16)
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1000}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),  # OpenAI's range is [0, 2]
        ({"top_p": 0}, "top_p"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"seed": -3}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 10**6]}, "prompt"),
        ({"logprobs": 21}, "logprobs"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"suffix": "x"}, "suffix"),
        ({"extra_body": {"bogus": 1}}, "bogus"),
    ],
)
def test_bad_completion_arguments_are_400(served, kwargs, param):
    args = {"model": MODEL, "prompt": "x", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        served["oai"].completions.create(**args)
    assert info.value.status_code == 400
    error = info.value.body if "message" in info.value.body else info.value.body["error"]
    assert error["param"] == param, error
    assert param in error["message"]
    assert error["type"] == "invalid_request_error"
    if kwargs.get("stop") == 5:  # says what is accepted: one string is, as a list is
        assert "a string or a list of strings" in error["message"], error
    if kwargs.get("temperature") == 2.5:
        assert "[0, 2]" in error["message"], error


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"messages": []}, "messages"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "messages",
        ),
        ({"n": 17}, "n"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"stream": True, "temperature": -1}, "temperature"),
        ({"temperature": 3}, "temperature"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ],
)
def test_bad_chat_arguments_are_400(served, kwargs, param):
    args = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 4,
        **kwargs,
    }
    with pytest.raises(openai.BadRequestError) as info:
        served["oai"].chat.completions.create(**args)
    error = info.value.body if "message" in info.value.body else info.value.body["error"]
    assert info.value.status_code == 400 and error["param"] == param, error


def test_unknown_model_and_bad_body(served):
    with pytest.raises(openai.NotFoundError):
        served["oai"].completions.create(model="nope", prompt="x", max_tokens=2)
    req = urllib.request.Request(
        served["url"] + "/completions",
        data=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400
    assert "error" in json.loads(info.value.read())


def wait_idle(client: Client, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        stats = client.stats()
        if stats["running"] == 0 and stats["queued"] == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"requests still running after {timeout_s} s: {client.stats()}")


def test_closing_a_stream_cancels_the_request(served):
    stream = served["oai"].completions.create(
        model=MODEL, prompt="Long story:", max_tokens=150, temperature=0, stream=True
    )
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].text)
        if got == 2:
            break
    assert served["client"].stats()["running"] == 1
    tokens = served["client"].stats()["tokens_generated"]
    stream.close()
    wait_idle(served["client"], 10)
    # cancelled, not finished: far fewer than 150 tokens were generated
    assert served["client"].stats()["tokens_generated"] - tokens < 100


def test_standalone_front_on_a_running_server(served, tmp_path):
    port = launch.free_port()
    env = launch.clean_env()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runtime.api.http.app",
            served["address"],
            "--http",
            f"127.0.0.1:{port}",
            "--model-name",
            "tiny",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}/v1"
        launch.wait_http(url, proc, "/dev/null", timeout_s=60)
        oai = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        assert [m.id for m in oai.models.list().data] == ["tiny"]
        out = oai.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0
        )
        ref = served["client"].generate("Once upon a time", max_new_tokens=6, temperature=0)
        assert out.choices[0].text == ref.text
        oai.close()
    finally:
        assert launch.stop(proc) == 0
        launch.assert_group_gone(proc.pid)


def test_non_loopback_http_refused_before_start(models, tmp_path):
    cfg = launch.write_config(tmp_path / "c.yaml", *models)
    res = subprocess.run(
        [sys.executable, "-m", "launcher", "serve", cfg, "--http", "0.0.0.0:8000"],
        capture_output=True,
        text=True,
        timeout=120,
        env=launch.clean_env(),
    )
    assert res.returncode == 2
    assert "--http" in res.stderr and "--http-allow-remote" in res.stderr


def test_sigterm_stops_server_cleanly(served):
    """Last: SIGTERM ends `tandem serve --http` with exit 0 and nothing left running."""
    proc = served["proc"]
    assert launch.stop(proc) == 0, open(served["log"]).read()[-4000:]
    launch.assert_group_gone(proc.pid)
