"""The Python handle: Engine.launch, generate, stream, argument errors, a dead engine."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest

from runtime import Engine, EngineDeadError
from runtime.config import ConfigError
from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(300)


class ImpatientEngine(Engine):
    """Declares a running server dead after 0.2 s of silence: far less than a startup."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, dead_after_s=0.2, **kwargs)


@pytest.fixture(scope="module")
def launched(tokenized_pair, tmp_path_factory):
    """The file's one Engine, an ImpatientEngine (test_launch_waits_for_a_slow_startup_...
    checks its launch), with what its launch showed: (engine, seconds the launch took, its
    dead_after_s right after the launch). The other tests use it with the Client's default
    silence limit (30 s) put back."""
    cfg = launch.write_config(
        tmp_path_factory.mktemp("cfg") / "c.yaml", *tokenized_pair, max_seq_len=128
    )
    start = time.monotonic()
    with ImpatientEngine.launch(cfg) as eng:
        took, dead_after_s = time.monotonic() - start, eng.dead_after_s
        eng.dead_after_s = 30.0  # generating may be silent longer
        yield eng, took, dead_after_s


@pytest.fixture(scope="module")
def engine(launched):
    return launched[0]


def test_generate_text_equals_target_greedy(engine, tokenized_pair):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenized_pair[1])
    out = engine.generate("Once upon a time", max_new_tokens=20)
    ids = tok.encode("Once upon a time")
    assert out.token_ids == checkpoints.hf_greedy(tokenized_pair[1], ids, 20)
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason == "length"
    assert {"acceptance_rate", "mean_accepted_tokens", "rounds", "tokens_per_s"} <= set(out.stats)


def test_lists_in_lists_out(engine):
    outs = engine.generate(["a", "bcd efg"], max_new_tokens=5)
    assert isinstance(outs, list) and len(outs) == 2
    assert outs[1].token_ids == engine.generate("bcd efg", max_new_tokens=5).token_ids
    one = engine.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=4)
    many = engine.generate(prompt_token_ids=[[1, 2, 3], [4]], max_new_tokens=4)
    assert len(many) == 2 and many[0].token_ids == one.token_ids


def test_stream_concatenates_to_generate(engine):
    full = engine.generate("The weather today", max_new_tokens=24)
    deltas = list(engine.stream("The weather today", max_new_tokens=24))
    assert len(deltas) > 1
    assert "".join(d.text for d in deltas) == full.text
    assert sum((d.token_ids for d in deltas), []) == full.token_ids


def test_stop_string_ends_text(engine):
    full = engine.generate("Numbers:", max_new_tokens=30)
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    out = engine.generate("Numbers:", max_new_tokens=30, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    streamed = "".join(d.text for d in engine.stream("Numbers:", max_new_tokens=30, stop=[stop]))
    assert streamed == out.text


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 10**6]}, "prompt_token_ids"),
        ({"prompt": "x", "max_new_tokens": 1000}, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "x", "temperature": -1.0}, "temperature"),
        ({"prompt": "x", "temperature": math.nan}, "temperature"),
        ({"prompt": "x", "top_p": 0.0}, "top_p"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "frequency": 2}, "frequency"),
    ],
)
def test_bad_arguments_raise_value_error(engine, kwargs, name):
    with pytest.raises(ValueError, match=name):
        engine.generate(**kwargs)


def test_bad_config_raises_before_any_process(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "draft: {model: /nope, devices: [cpu:0]}\ntarget: {model: /nope, devices: [cpu:1]}\n"
    )
    start = time.monotonic()
    with pytest.raises(ConfigError, match="draft.model"):
        Engine.launch(str(cfg))
    assert time.monotonic() - start < 10


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def test_killed_worker_raises_engine_dead(tokenized_pair, tmp_path):
    cfg = launch.write_config(tmp_path / "c.yaml", *tokenized_pair, max_seq_len=128)
    engine = Engine.launch(cfg)
    try:
        server = engine._process.pid
        workers = children(server)
        assert len(workers) == 2
        engine.generate(prompt_token_ids=[1, 2], max_new_tokens=2)
        os.kill(workers[-1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            engine.generate(prompt_token_ids=[1, 2], max_new_tokens=100)
            engine.generate(prompt_token_ids=[1, 2], max_new_tokens=100)
        assert time.monotonic() - start < 10
        with pytest.raises(EngineDeadError):
            engine.generate(prompt_token_ids=[1, 2], max_new_tokens=2)
        engine._process.wait(30)
        assert engine._process.returncode != 0
    finally:
        engine.close()
    launch.assert_group_gone(server)


def test_launch_waits_for_a_slow_startup_then_restores_the_liveness_limit(launched):
    """Loading (and on GPUs capturing CUDA graphs) may outlast the silence allowed to a
    running server: launch waits up to the startup timeout instead."""
    eng, took, dead_after_s = launched
    assert took > 0.2  # the startup took longer than the limit
    assert dead_after_s == 0.2
    out = eng.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=4)
    assert len(out.token_ids) == 4
