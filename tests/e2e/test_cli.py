"""The `tandem` command line: bad input exits 2 naming the problem before any worker starts;
the built-in demo prints real text."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = checkpoints.build_checkpoint(root / "target", "llama", seed=0)
    small_vocab = checkpoints.build_checkpoint(root / "v80", "llama", seed=0, vocab_size=80)
    return target, small_vocab


def tandem(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=launch.clean_env(),
    )


def write(tmp_path, config: dict) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def base(target) -> dict:
    return {
        "draft": {"model": target, "devices": ["cpu:0"], "dtype": "float32"},
        "target": {"model": target, "devices": ["cpu:1"], "dtype": "float32"},
    }


@pytest.mark.parametrize(
    "mutate,key",
    [
        (lambda c: c.update(bogus=1), "bogus"),
        (lambda c: c["draft"].update(devices=[]), "draft.devices"),
        (lambda c: c["target"].update(devices=["cpu:1", "cpu:1"]), "target.devices"),
        (lambda c: c.update(speculation={"draft_len": 0}), "speculation.draft_len"),
        (lambda c: c.update(speculation={"acceptance": "maybe"}), "speculation.acceptance"),
        (lambda c: c["draft"].update(model="/does/not/exist"), "draft.model"),
        (lambda c: c["draft"].update(dtype="float8"), "draft.dtype"),
        (lambda c: c.update(runtime={"max_batch_size": "8"}), "runtime.max_batch_size"),
        (lambda c: c["target"].update(devices=[0]), "target.devices"),
    ],
)
def test_bad_config_exits_2_naming_the_key(mutate, key, tiny, tmp_path):
    config = base(tiny[0])
    mutate(config)
    start = time.monotonic()
    res = tandem("run", write(tmp_path, config), "--prompt-ids", "1,2")
    assert res.returncode == 2, res.stderr
    assert key in res.stderr
    assert time.monotonic() - start < 60


def test_vocab_mismatch_is_a_config_error(tiny, tmp_path):
    config = base(tiny[0])
    config["draft"]["model"] = tiny[1]
    res = tandem("run", write(tmp_path, config), "--prompt-ids", "1,2")
    assert res.returncode == 2 and "draft.model" in res.stderr and "80" in res.stderr


def test_bad_request_arguments_exit_2(tiny, tmp_path):
    cfg = write(tmp_path, base(tiny[0]))
    cases = (
        (["--prompt-ids", "1,x"], "--prompt-ids"),
        (["--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--prompt-ids", "1", "--top-p", "0"], "--top-p"),
        (["--prompt-ids", "1", "--temperature", "-1"], "--temperature"),
    )
    # started at once (each is one busy core: an interpreter importing torch), then checked
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "launcher", "run", cfg, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=launch.clean_env(),
        )
        for args, _ in cases
    ]
    try:
        for proc, (args, name) in zip(procs, cases):
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 2 and name in err, (args, err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_token_outside_vocab_exits_2(tiny, tmp_path):
    res = launch.run("spawn", 3, ["run", write(tmp_path, base(tiny[0])), "--prompt-ids", "1,96"])
    assert res.returncode == 2 and "outside the vocabulary" in res.stderr


@pytest.mark.parametrize("form,ranks", [("torchrun", 2), ("mpirun", 4)])
def test_wrong_world_size_names_expected(form, ranks, tiny, tmp_path):
    cfg = write(tmp_path, base(tiny[0]))
    res = launch.run(form, ranks, ["run", cfg, "--prompt-ids", "1,2"], timeout=120)
    assert res.returncode != 0
    assert "expected W=3" in res.stderr


def _wait_for(proc, when: str, timeout_s: float = 120) -> None:
    """Until `proc` (a `tandem run`) is starting its workers ("starting": a child runs) or
    generating ("generating": its stderr said ready)."""
    from tests.processes import descendants

    deadline = time.monotonic() + timeout_s
    if when == "starting":
        while not descendants(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "no worker started"
            time.sleep(0.02)
        return
    for line in proc.stderr:
        if line.startswith("tandem: ready: "):
            time.sleep(0.5)  # a few rounds in
            return
    raise AssertionError(f"tandem run ended before it was ready: {proc.wait()}")


@pytest.mark.parametrize("when, gap_s", [("starting", 0.0), ("starting", 0.3), ("generating", 0.0)])
def test_json_survives_a_second_sigint(tiny, tmp_path, when, gap_s):
    """`timeout -s INT` signals the process and then its group: tandem run --json still
    prints its one object per prompt (what was generated, finish_reason cancelled) and
    exits at once, with every worker gone."""
    model = checkpoints.build_checkpoint(
        tmp_path / "no-eos", "llama", seed=0, eos_token_id=None
    )  # generates all 500 tokens
    config = dict(base(model), runtime={"max_seq_len": 512})
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            "run",
            write(tmp_path, config),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "500",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=launch.clean_env(),
    )
    try:
        _wait_for(proc, when)
        os.kill(proc.pid, signal.SIGINT)  # as timeout does: the process, then its group
        time.sleep(gap_s)
        os.killpg(proc.pid, signal.SIGINT)
        start = time.monotonic()
        out, err = proc.communicate(timeout=60)
        seconds = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    launch.assert_group_gone(proc.pid)
    # 130; or killed by the SIGINT itself when it came as the process was ending anyway
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, err)
    assert seconds < 20, f"took {seconds:.1f} s to exit"
    assert out.count("\n") == 1, (out, err)
    obj = json.loads(out)
    assert set(obj) >= {"text", "token_ids", "finish_reason", "stats"}, obj
    assert obj["finish_reason"] == "cancelled" and len(obj["token_ids"]) < 500, obj
    if when == "starting":
        assert obj["token_ids"] == [], obj
    assert "Traceback" not in err, err


# the default demo as a user runs it: tests/e2e/test_demo_cache.py


def test_cpu_demo_config_runs_offline(tmp_path):
    """examples/configs/cpu-demo.yaml after the Quickstart's install only: no Hugging Face
    cache, the Hub offline (its model is builtin:smollm2-135m)."""
    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "cpu-demo.yaml"
    env = dict(
        launch.clean_env(),
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_CACHE=str(tmp_path / "hf" / "hub"),
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "run",
            str(config),
            "--prompt",
            "The capital of France is",
            "--max-new-tokens",
            "6",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert len(out["token_ids"]) == 6 and out["text"].strip(), out
