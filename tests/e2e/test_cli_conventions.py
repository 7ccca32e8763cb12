"""The command line as a new user meets it: --version and --help, --print-config, errors that
name the flag or key before any process starts, streamed text, Ctrl-C, the served model name
of the HTTP API, and output free of other libraries' noise."""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import time
from importlib.metadata import version

import pytest
import yaml

from runtime.config import default_config, load_config
from tests import checkpoints, launch
from tests.processes import descendants

pytestmark = pytest.mark.timeout(300)

PROMPTS = ("Once upon a time", "The weather today")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    target = checkpoints.build_with_tokenizer(root / "target", seed=0)
    draft = checkpoints.build_near_draft(target, root / "draft", noise=0.05)
    bare = checkpoints.build_checkpoint(root / "bare", "llama", seed=0)  # no tokenizer
    return {"draft": draft, "target": target, "bare": bare, "root": root}


@pytest.fixture(scope="module")
def cfg(models) -> str:
    return launch.write_config(
        models["root"] / "c.yaml", models["draft"], models["target"], max_seq_len=512
    )


def tandem(*args, timeout=120, env=None):
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or launch.clean_env(),
    )


# --- --version, --help ----------------------------------------------------------------------
def test_version_is_the_installed_package_version():
    res = tandem("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"tandem {version('tandem')}"


def test_help_lists_only_the_public_commands():
    res = tandem("--help")
    assert res.returncode == 0
    assert "{run,serve,bench}" in res.stdout and "--version" in res.stdout
    assert "worker" not in res.stdout and "SUPPRESS" not in res.stdout
    run_help = tandem("run", "--help").stdout
    assert "(default: 64)" in run_help and "--no-stream" in run_help
    # the hidden entry rank 0 starts workers with still parses
    worker = tandem("worker", "--help")
    assert worker.returncode == 0 and "--rank" in worker.stdout


def test_top_level_help_says_where_each_commands_options_are():
    """`tandem --help` lists the commands, not their options: it says where those are."""
    res = tandem("--help")
    assert res.returncode == 0
    assert "tandem COMMAND --help" in " ".join(res.stdout.split()), res.stdout


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_has_help_that_gives_its_default():
    from launcher.cli_parser import build_parser

    for name, sub in _subparsers(build_parser()).items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{label} has no help"
            if action.required or (
                action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
            ):
                continue  # nothing to default (a required value, a plain flag)
            assert "default" in formatter._get_help_string(action) % vars(action), (
                f"{label}: its help does not say its default"
            )


# --- --print-config ---------------------------------------------------------------------------
def test_print_config_round_trips_through_load_config(models, tmp_path):
    path = tmp_path / "short.yaml"  # no runtime.max_seq_len: the models' context is used
    path.write_text(
        yaml.safe_dump(
            {
                "draft": {"model": models["draft"], "devices": ["cpu:0"], "dtype": "float32"},
                "target": {"model": models["target"], "devices": ["cpu:1"], "dtype": "float32"},
            }
        )
    )
    res = tandem("run", str(path), "--print-config")
    assert res.returncode == 0, res.stderr
    printed = yaml.safe_load(res.stdout)
    assert printed["runtime"]["max_seq_len"] == 512  # max_position_embeddings
    assert load_config(printed) == load_config(str(path))
    served = tandem(
        "serve",
        str(path),
        "--address",
        "ipc:///tmp/x.sock",
        "--shutdown-timeout",
        "3",
        "--print-config",
    )
    server = yaml.safe_load(served.stdout)["server"]
    assert server["address"] == "ipc:///tmp/x.sock" and server["shutdown_timeout_s"] == 3.0
    bad = tandem("serve", str(path), "--shutdown-timeout", "-1")
    assert bad.returncode == 2 and "--shutdown-timeout" in bad.stderr, bad.stderr


def _schema_keys() -> set[str]:
    """Every dotted key of the config schema, from the dataclasses themselves."""
    from dataclasses import fields

    from runtime.config import ModelConfig, TandemConfig

    keys = set()
    for top in fields(TandemConfig):
        section = (
            ModelConfig
            if top.name in ("draft", "target")
            else top.default_factory
            if callable(top.default_factory)
            else None
        )
        if section is None:
            keys.add(top.name)
        else:
            keys |= {f"{top.name}.{f.name}" for f in fields(section)}
    return keys


def test_print_config_shows_every_key_of_the_schema(cfg):
    """Unset optional keys too (quantization, kv_cache_memory: null): the printed YAML shows
    the whole schema."""
    res = tandem("run", cfg, "--print-config")
    assert res.returncode == 0, res.stderr
    printed = yaml.safe_load(res.stdout)
    shown = {
        f"{top}.{key}"
        for top, section in printed.items()
        if isinstance(section, dict)
        for key in section
    } | {top for top, value in printed.items() if not isinstance(value, dict)}
    missing = _schema_keys() - shown
    assert not missing, f"--print-config omits {sorted(missing)}"
    for model in ("draft", "target"):
        assert printed[model]["quantization"] is None, printed
        assert printed[model]["kv_cache_memory"] is None, printed
    assert load_config(printed) == load_config(cfg)


def test_demo_print_config_is_the_builtin_default():
    try:
        expected = default_config()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    res = tandem("run", "--print-config")
    assert res.returncode == 0, res.stderr
    assert load_config(yaml.safe_load(res.stdout)) == expected


def test_serve_without_config_is_the_builtin_demo():
    """`tandem serve` defaults to the demo as `tandem run` does; --address still applies."""
    try:
        expected = default_config()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    res = tandem("serve", "--print-config")
    assert res.returncode == 0, res.stderr
    assert load_config(yaml.safe_load(res.stdout)) == expected
    moved = tandem("serve", "--address", "ipc:///tmp/x.sock", "--print-config")
    assert moved.returncode == 0, moved.stderr
    printed = yaml.safe_load(moved.stdout)
    assert printed["server"]["address"] == "ipc:///tmp/x.sock"
    assert dict(printed, server=None) == dict(yaml.safe_load(res.stdout), server=None)


@pytest.mark.parametrize("command", ["run", "serve"])
def test_missing_config_file_names_its_path(tmp_path, command):
    path = tmp_path / "nope.yaml"
    res = tandem(command, str(path))
    assert res.returncode == 2, res.stderr
    assert res.stderr == f"tandem: error: {path}: the config file does not exist\n", res.stderr


# --- errors: the flag the user typed, before anything starts --------------------------------
REQUEST_ERRORS = [
    (["--prompt-ids", "1,x"], "--prompt-ids: expected comma-separated integers"),
    (["--prompt-ids", "1,99999"], "--prompt-ids: token id 99999 is outside the vocabulary"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens: expected an integer"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "511"], "exceeds runtime.max_seq_len (512)"),
    (["--prompt-ids", "1", "--top-p", "0"], "--top-p: expected a number in (0, 1]"),
    (["--prompt-ids", "1", "--top-k", "-1"], "--top-k: expected an integer >= 0"),
    (["--prompt-ids", "1", "--temperature", "-1"], "--temperature: expected a finite"),
    (["--prompt", ""], "--prompt: empty prompt"),
]


@pytest.fixture(scope="module")
def request_errors(cfg):
    """`tandem run CFG ARGS` of every case of test_request_errors_name_the_flag, started at
    once: each is one busy core (an interpreter that imports torch, then exits 2), so they
    share the host's cores; each test waits for its own."""
    procs = {
        tuple(args): subprocess.Popen(
            [sys.executable, "-m", "launcher", "run", cfg, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=launch.clean_env(),
        )
        for args, _ in REQUEST_ERRORS
    }
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("args, expected", REQUEST_ERRORS)
def test_request_errors_name_the_flag(request_errors, args, expected):
    proc = request_errors[tuple(args)]
    out, err = proc.communicate(timeout=120)
    res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("tandem: error: ") and expected in res.stderr, res.stderr
    for python_name in ("prompt_token_ids", "max_new_tokens", "top_p", "top_k"):
        assert python_name not in res.stderr, res.stderr


def _run_watching_children(args: list[str], timeout: float = 60):
    """Run `tandem ARGS`; (result, seconds, whether it ever had a child process)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=launch.clean_env(),
    )
    had_child = False
    while proc.poll() is None and time.monotonic() - start < timeout:
        had_child = had_child or bool(descendants(proc.pid))
        time.sleep(0.02)
    try:
        out, err = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"tandem {args} did not exit within {timeout} s") from None
    launch.assert_group_gone(proc.pid)
    return (
        subprocess.CompletedProcess(args, proc.returncode, out, err),
        time.monotonic() - start,
        had_child,
    )


def _config_case(models, tmp_path, case: str) -> tuple[list[str], str]:
    """(tandem arguments, what the error must say) for one config problem."""
    base = yaml.safe_load(
        open(launch.write_config(tmp_path / "b.yaml", models["draft"], models["target"]))
    )
    if case == "duplicate key":
        del base["runtime"]
        text = (
            yaml.safe_dump(base) + "runtime:\n  max_seq_len: 64\n  max_batch_size: 2\n"
            "  max_seq_len: 128\n"
        )
        (tmp_path / "c.yaml").write_text(text)
        return ["--prompt-ids", "1,2"], "runtime.max_seq_len: duplicate key"
    if case == "max_seq_len over context":
        base["runtime"]["max_seq_len"] = 4096
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(base))
        return (
            ["--prompt-ids", "1,2"],
            "runtime.max_seq_len: 4096 exceeds the draft model's context: "
            "max_position_embeddings is 512",
        )
    base["draft"]["model"] = base["target"]["model"] = models["bare"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(base))
    if case == "no tokenizer for --prompt":
        return ["--prompt", "Hello"], f"--prompt: {models['bare']} has no tokenizer"
    return ["--prompt-ids", "1", "--stop", "x"], f"--stop: {models['bare']} has no tokenizer"


@pytest.mark.parametrize(
    "case",
    [
        "duplicate key",
        "max_seq_len over context",
        "no tokenizer for --prompt",
        "no tokenizer for --stop",
    ],
)
def test_config_errors_exit_2_before_any_process_starts(models, tmp_path, case):
    args, expected = _config_case(models, tmp_path, case)
    res, seconds, had_child = _run_watching_children(["run", str(tmp_path / "c.yaml"), *args])
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("tandem: error: ") and res.stderr.count("\n") == 1, res.stderr
    assert expected in res.stderr, res.stderr
    assert not had_child, "a worker was started"
    assert seconds < 15, f"took {seconds:.1f} s"


@pytest.mark.parametrize("section", ["runtime", "draft", "speculation", "server"])
def test_unknown_key_lists_the_allowed_keys_as_documented(cfg, tmp_path, section):
    """The list of allowed keys is the section's own keys, each once and unprefixed as in
    the YAML (the flag wording of `run`'s errors once turned max_seq_len into
    runtime.max_seq_len there)."""
    from dataclasses import fields

    from runtime.config import ModelConfig, RuntimeConfig, ServerConfig, SpeculationConfig

    config = yaml.safe_load(open(cfg))
    config.setdefault(section, {})["bogus"] = 1
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    for command in ("run", "serve"):
        res = tandem(command, str(path), *(["--prompt-ids", "1"] if command == "run" else []))
        assert res.returncode == 2, res.stderr
        line = res.stderr.strip()
        assert line.startswith(
            f"tandem: error: {section}.bogus: unknown key; allowed keys here: "
        ), line
        cls = {
            "runtime": RuntimeConfig,
            "draft": ModelConfig,
            "speculation": SpeculationConfig,
            "server": ServerConfig,
        }[section]
        listed = line.split("allowed keys here: ", 1)[1].split(", ")
        assert listed == [f.name for f in fields(cls)], line


LONG_TEXT = "Once upon a time there was a tokenizer. " * 200  # well over 512 tokens
TOO_LONG = [  # (arguments, what the error says, what it must not say)
    (
        ["--prompt", LONG_TEXT],
        r"--prompt: the prompt is \d+ tokens, too long for "
        r"runtime\.max_seq_len \(512\)",
        "--max-new-tokens",
    ),
    (
        ["--prompt", PROMPTS[0], "--prompt", LONG_TEXT],
        r"--prompt: prompt 2 is \d+ tokens, too long for runtime\.max_seq_len \(512\)",
        "--max-new-tokens",
    ),
    (
        ["--prompt", PROMPTS[0], "--max-new-tokens", "510"],
        r"--max-new-tokens: the prompt \(\d+ tokens\) \+ --max-new-tokens \(510\) exceeds "
        r"runtime\.max_seq_len \(512\); at most \d+ new tokens fit",
        None,
    ),
    (
        ["--prompt-ids", ",".join(["1"] * 600)],
        r"--prompt-ids: the prompt is 600 tokens, too long for runtime\.max_seq_len \(512\)",
        "--max-new-tokens",
    ),
]


@pytest.mark.parametrize(
    "args, expected, absent", TOO_LONG, ids=["text", "second text", "text + new tokens", "ids"]
)
def test_a_prompt_that_cannot_fit_is_refused_before_any_worker_starts(cfg, args, expected, absent):
    """rank 0 tokenises first: the error names the prompt (its token count) and
    runtime.max_seq_len, and --max-new-tokens only where that is what overflows."""
    import re

    res, seconds, had_child = _run_watching_children(["run", cfg, *args])
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("tandem: error: ") and res.stderr.count("\n") == 1, res.stderr
    assert re.search(expected, res.stderr), res.stderr
    assert absent is None or absent not in res.stderr, res.stderr
    assert not had_child, "a worker was started"
    assert seconds < 15, f"took {seconds:.1f} s"


def test_served_model_name_needs_http(cfg):
    res = tandem("serve", cfg, "--served-model-name", "m")
    assert res.returncode == 2 and "--served-model-name" in res.stderr and "--http" in res.stderr


# --- tandem run: streaming, Ctrl-C, the worker-side KV budget --------------------------------
def _lines_after_startup(stderr: str) -> list[str]:
    """stderr's lines after the startup progress (which ends with 'tandem: ready: ...')."""
    lines = stderr.splitlines()
    ready = [i for i, line in enumerate(lines) if line.startswith("tandem: ready: ")]
    assert ready, stderr
    return lines[ready[-1] + 1 :]


def test_several_prompts_print_in_order_as_json_says(cfg):
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    args = ["run", cfg, *prompts, "--max-new-tokens", "24"]
    outs = launch.run_json("spawn", 3, args)
    streamed = launch.run("spawn", 3, args)
    assert streamed.returncode == 0, streamed.stderr
    texts = [o["text"].replace("\r\n", "\n").replace("\r", "\n") for o in outs]  # text mode
    assert streamed.stdout == "".join(text + "\n" for text in texts)
    after = _lines_after_startup(streamed.stderr)
    assert len(after) == 2 and all(" tokens, finish=" in line for line in after), after
    no_stream = launch.run("spawn", 3, [*args, "--no-stream"])
    assert no_stream.stdout == streamed.stdout
    for res in (streamed, no_stream):
        assert "WARNING" not in res.stderr and "Traceback" not in res.stderr, res.stderr


@pytest.mark.parametrize("to", ["leader", "group"])  # `kill -INT pid` / Ctrl-C in a terminal
def test_ctrl_c_prints_what_was_generated_and_exits_130(cfg, to):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            "run",
            cfg,
            "--prompt",
            PROMPTS[0],
            "--max-new-tokens",
            "480",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=launch.clean_env(),
    )
    try:
        first = os.read(proc.stdout.fileno(), 64)  # the text streams: it comes while running
        assert first and proc.poll() is None
        (os.kill if to == "leader" else os.killpg)(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    launch.assert_group_gone(proc.pid)
    out, err = (first + rest).decode(), err.decode()
    assert proc.returncode == 130, err
    after = _lines_after_startup(err)
    assert len(after) == 1 and after[0].startswith("tandem: interrupted by SIGINT after "), err
    generated = int(after[0].split(" after ")[1].split()[0])
    assert 0 < generated < 480 and out.endswith("\n") and out.strip(), (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "WARNING" not in err


def test_kv_budget_failure_in_a_worker_is_one_error_line(models, tmp_path):
    path = launch.write_config(tmp_path / "c.yaml", models["draft"], models["target"])
    config = yaml.safe_load(open(path))
    config["target"]["kv_cache_memory"] = 1e-9  # CPU: only the worker checks the budget
    open(path, "w").write(yaml.safe_dump(config))
    res = launch.run("spawn", 3, ["run", path, "--prompt-ids", "1,2"], timeout=120)
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("tandem: error: target: KV cache needs "), (
        res.stderr
    )
    assert "target.kv_cache_memory" in errors[0]
    assert "Traceback" not in res.stderr and "WARNING" not in res.stderr, res.stderr


# --- tandem serve --served-model-name, through the openai client ----------------------------
def test_served_model_name_through_the_openai_client(cfg, tmp_path):
    openai = pytest.importorskip("openai")
    port, log_path = launch.free_port(), tmp_path / "serve.log"
    proc = launch.start_serve(
        cfg,
        f"ipc://{tmp_path}/s.sock",
        "--http",
        f"127.0.0.1:{port}",
        "--served-model-name",
        "tiny-chat",
        log_path=log_path,
    )
    try:
        launch.wait_http(f"http://127.0.0.1:{port}", proc, log_path)
        oai = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120
        )
        assert [m.id for m in oai.models.list().data] == ["tiny-chat"]
        out = oai.completions.create(
            model="tiny-chat", prompt=PROMPTS[0], max_tokens=8, temperature=0
        )
        assert out.model == "tiny-chat" and out.usage.completion_tokens == 8
        for call in (
            lambda: oai.completions.create(model="target", prompt="a", max_tokens=2),
            lambda: oai.models.retrieve("target"),
        ):
            with pytest.raises(openai.NotFoundError) as info:
                call()
            assert "`target` does not exist" in str(info.value)
            assert "serves `tiny-chat`" in str(info.value)
        oai.close()
        assert launch.stop(proc) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    launch.assert_group_gone(proc.pid)
    text = open(log_path).read()
    assert "WARNING" not in text and "Traceback" not in text, text  # a normal stop is quiet


# --- quiet by default ---------------------------------------------------------------------------
def test_engine_keeps_its_servers_address_line_to_itself():
    from runtime.api.engine import StderrTail

    read, write = os.pipe()
    sink = io.StringIO()
    tail = StderrTail(os.fdopen(read, "rb"), forward=sink)
    with os.fdopen(write, "wb") as pipe:
        pipe.write(
            b"tandem: loading weights (1 worker)\n"
            b"tandem: serving at ipc:///tmp/tandem-x/server.sock\n"
            b"tandem: error: rank 1 exited\n"
        )
    assert tail.detail() == "rank 1 exited"
    assert sink.getvalue() == "tandem: loading weights (1 worker)\ntandem: error: rank 1 exited\n"


def test_bench_prints_its_table_and_progress_only(tmp_path):
    env = launch.clean_env()
    env.pop("TANDEM_LOG", None)
    res = tandem(
        "bench",
        "--synthetic",
        "tiny",
        "--modes",
        "spec,hf",
        "--prompt-len",
        "8",
        "--new-tokens",
        "8",
        "--warmup",
        "0",
        "--out",
        str(tmp_path / "r.json"),
        timeout=280,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("| mode | batch |") and "| spec | 1 |" in res.stdout
    assert "bench: spec: batch 1" in res.stderr
    for noise in (
        "Loading weights",
        "Writing model shards",
        "deprecated",
        "serving at",
        "WARNING",
        "received signal",
        "it/s]",
    ):
        assert noise not in res.stderr, res.stderr
    assert json.loads((tmp_path / "r.json").read_text())["results"]
