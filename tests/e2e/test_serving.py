"""Serving many clients at once from one `tandem serve`: in-flight batching with queueing,
per-request sampling, streaming, cancellation (closed streams, vanished clients), batched
throughput, and a clean SIGTERM."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from runtime import Client
from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(300)

MAX_BATCH = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    # long positions so that one request can outlast the server's 10 s client timeout
    target = checkpoints.build_with_tokenizer(root / "target", seed=3, max_position_embeddings=4096)
    draft = checkpoints.build_near_draft(target, root / "draft", noise=0.05)
    return draft, target


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    cfg = launch.write_config(root / "c.yaml", *models, max_batch_size=MAX_BATCH, max_seq_len=2048)
    address = f"ipc://{root}/server.sock"
    log_path = root / "serve.log"
    env = dict(launch.clean_env(), TANDEM_LAUNCH="spawn")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", "serve", cfg, "--address", address],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    client = Client(address)
    try:
        client.info(timeout_s=180)
        yield {"proc": proc, "address": address, "client": client, "log": log_path}
    finally:
        client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        launch.assert_group_gone(proc.pid)


@pytest.fixture(scope="module")
def tokenizer(models):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(models[1])


def hf_greedy_many(
    model_path: str, prompts: list[list[int]], new_tokens: list[int]
) -> list[list[int]]:
    """checkpoints.hf_greedy for several prompts, loading the model once."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    return [checkpoints.hf_generate(model, ids, n) for ids, n in zip(prompts, new_tokens)]


def wait_until(client: Client, pred, timeout_s: float, poll_s: float = 0.05) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if pred(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s: {stats}")
        time.sleep(poll_s)


def idle(stats: dict) -> bool:
    return stats["running"] == 0 and stats["queued"] == 0


WORDS = (
    "the river",
    "a small cat",
    "numbers",
    "tomorrow we",
    "in the old house",
    "why",
    "green light over the harbour",
    "seven",
    "once",
    "music and",
    "a long time ago in",
    "she said",
    "data",
    "clouds",
    "the end of the road is near",
    "hello",
)


def make_requests(tokenizer) -> list[dict]:
    """16 requests: text and token-id prompts of different lengths, different lengths of
    output, greedy (even) and sampled (odd) with different settings."""
    rng = random.Random(0)
    reqs = []
    for i in range(16):
        if i % 4 == 3:
            ids = [rng.randrange(3, 40000) for _ in range(rng.randrange(2, 60))]
            req = {"prompt_token_ids": ids}
        else:
            text = WORDS[i] * (1 + i % 3)
            req = {"prompt": text}
            ids = tokenizer.encode(text)
        kwargs = {"max_new_tokens": 10 + (i * 7) % 40}
        if i % 2:  # sampled rounds cost more on the CPU (49152-token vocabulary): shorter
            kwargs["max_new_tokens"] = 8 + i % 9
            kwargs.update(
                temperature=(0.6, 0.9, 1.0, 1.3)[i % 4 // 2 + (i // 8) * 2],
                top_k=(None, 20)[i % 3 % 2],
                top_p=(1.0, 0.9)[(i // 3) % 2],
                seed=100 + i,
            )
        else:
            kwargs["temperature"] = 0.0
        reqs.append({"req": req, "ids": ids, "kwargs": kwargs})
    return reqs


def test_sixteen_concurrent_streams(server, models, tokenizer):
    reqs = make_requests(tokenizer)
    results: list[list | None] = [None] * len(reqs)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(reqs))
    max_queued = [0]
    stop_watch = threading.Event()

    def watch():
        while not stop_watch.is_set():
            stats = server["client"].stats()
            if stats["running"] == MAX_BATCH:
                max_queued[0] = max(max_queued[0], stats["queued"])
            time.sleep(0.02)

    def one(i):
        try:
            with Client(server["address"]) as client:
                client.info()
                barrier.wait(60)
                results[i] = list(client.stream(**reqs[i]["req"], **reqs[i]["kwargs"]))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    stop_watch.set()
    watcher.join(5)
    assert not errors, errors
    assert max_queued[0] > 0, "16 requests on 8 slots never queued"

    greedy = [i for i, r in enumerate(reqs) if r["kwargs"]["temperature"] == 0]
    want = hf_greedy_many(
        models[1],
        [reqs[i]["ids"] for i in greedy],
        [reqs[i]["kwargs"]["max_new_tokens"] for i in greedy],
    )
    client = server["client"]
    for i, deltas in enumerate(results):
        assert deltas is not None and len(deltas) > 1, (i, deltas)
        assert all(d.index == 0 for d in deltas)
        text = "".join(d.text for d in deltas)
        ids = sum((d.token_ids for d in deltas), [])
        if i in greedy:
            assert ids == want[greedy.index(i)], f"request {i} differs from transformers"
            # the server's final text is the decoded tokens (the stream's deltas add up to it)
            assert text == tokenizer.decode(ids, skip_special_tokens=True), i
        else:
            # sampled with a seed: the same tokens and text as the request run alone
            alone = client.generate(**reqs[i]["req"], **reqs[i]["kwargs"])
            assert ids == alone.token_ids, i
            assert text == alone.text, i
            assert len(ids) == reqs[i]["kwargs"]["max_new_tokens"] or alone.finish_reason == "stop"
    wait_until(client, idle, 10)


def test_batched_throughput_beats_sequential(server):
    client = server["client"]
    rng = random.Random(1)
    prompts = [
        [rng.randrange(3, 40000) for _ in range(rng.randrange(3, 30))] for _ in range(MAX_BATCH)
    ]
    kwargs = {"max_new_tokens": 40, "temperature": 0.0}
    client.generate(prompt_token_ids=prompts[0], max_new_tokens=4)  # warm

    start = time.perf_counter()
    sequential = [client.generate(prompt_token_ids=p, **kwargs) for p in prompts]
    t_sequential = time.perf_counter() - start

    outs: list = [None] * len(prompts)

    def one(i):
        outs[i] = client.generate(prompt_token_ids=prompts[i], **kwargs)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    t_batched = time.perf_counter() - start

    assert [o.token_ids for o in outs] == [o.token_ids for o in sequential]
    tokens = sum(len(o.token_ids) for o in outs)
    print(
        f"\n{len(prompts)} requests, {tokens} tokens: sequential {t_sequential:.2f} s "
        f"({tokens / t_sequential:.0f} tok/s), concurrent {t_batched:.2f} s "
        f"({tokens / t_batched:.0f} tok/s)"
    )
    assert t_batched < t_sequential, (t_batched, t_sequential)


def test_chatty_clients_do_not_starve_the_rounds(server):
    """Clients that send frames more often than every 50 ms (stats polling, many pingers)
    must not keep the server loop from running rounds."""
    stop = threading.Event()

    def hammer():
        with Client(server["address"]) as chatty:
            deadline = time.monotonic() + 20
            while not stop.is_set() and time.monotonic() < deadline:
                chatty.stats()
                time.sleep(0.005)

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)
        start = time.monotonic()
        out = server["client"].generate(
            prompt_token_ids=[7, 8, 9], max_new_tokens=24, temperature=0
        )
        took = time.monotonic() - start
    finally:
        stop.set()
        thread.join(30)
    assert len(out.token_ids) == 24
    assert took < 8, f"a 24-token request took {took:.1f} s next to a chatty client"


def test_closing_a_stream_frees_the_slot(server):
    client = server["client"]
    stream = client.stream(prompt_token_ids=[5, 6, 7], max_new_tokens=1500, temperature=0)
    next(stream)
    next(stream)
    before = client.stats()
    assert before["running"] == 1
    stream.close()
    after = wait_until(client, idle, 5, poll_s=0.01)
    # the cancel is handled between rounds: the slot is free after a round or two
    assert after["rounds"] - before["rounds"] <= 3, (before, after)
    assert after["tokens_generated"] - before["tokens_generated"] < 50


CLIENT_SCRIPT = """
import sys
from runtime import Client
client = Client(sys.argv[1])
for delta in client.stream(prompt_token_ids=[[11, 12, 13], [14, 15]], max_new_tokens=1900,
                           temperature=0):
    print("delta", flush=True)
"""


def test_vanished_client_gets_cancelled(server):
    client = server["client"]
    before = client.stats()
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT_SCRIPT, server["address"]],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=launch.clean_env(),
        cwd=os.getcwd(),
    )
    try:
        assert proc.stdout.readline().strip() == "delta"
        assert client.stats()["running"] == 2
        os.killpg(proc.pid, signal.SIGKILL)  # gone without a word: no cancel is sent
        proc.wait(10)
        killed = time.monotonic()
        after = wait_until(client, idle, 20, poll_s=0.2)
        waited = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # cancelled after the server's client timeout (10 s), long before the request's end
    assert 5 < waited < 16, waited
    assert after["tokens_generated"] - before["tokens_generated"] < 2 * 1900


def test_requests_beyond_max_batch_size_queue(server):
    client = server["client"]
    rows = [[20 + i, 21 + i, 22 + i] for i in range(MAX_BATCH + 4)]
    stream = client.stream(prompt_token_ids=rows, max_new_tokens=1500, temperature=0)
    next(stream)
    stats = client.stats()
    assert stats["running"] == MAX_BATCH and stats["queued"] == 4, stats
    stream.close()  # cancels the running and the queued sequences
    wait_until(client, idle, 5)


def test_sigterm_stops_the_server_cleanly(server):
    """Last: SIGTERM ends `tandem serve` with exit 0 and nothing left running."""
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, open(server["log"]).read()[-4000:]
    launch.assert_group_gone(proc.pid)
