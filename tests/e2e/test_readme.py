"""The README's examples run as written, against the tiny models: its Python snippets (the
Engine one and the OpenAI one, `config.yaml` and the port swapped for a test's), its curl
request and the `tandem run` lines of its command-line snippet. (The Quickstart's two
commands are what CI runs; the launch forms are the e2e tests' own subject.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import launch

pytestmark = pytest.mark.timeout(300)
README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)
TANDEM = str(launch.BIN / "tandem")


def block(lang: str, marker: str) -> str:
    found = [body for kind, body in BLOCKS if kind == lang and marker in body]
    assert len(found) == 1, f"README: one {lang} block with {marker!r} expected"
    return found[0]


@pytest.fixture(scope="module")
def config(tokenized_pair, tmp_path_factory) -> str:
    return launch.write_config(
        tmp_path_factory.mktemp("readme") / "config.yaml", *tokenized_pair, max_seq_len=128
    )


def test_python_snippet_runs(config, tmp_path):
    code = block("python", "Engine.launch").replace('"config.yaml"', repr(config))
    res = subprocess.run(
        [sys.executable, "-c", code], text=True, capture_output=True, timeout=240, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip()


def test_command_line_snippet_runs(config, tmp_path):
    lines = [
        line.split("#")[0].strip() for line in block("bash", "tandem run config.yaml").splitlines()
    ]
    runs = [line for line in lines if line.startswith("tandem run config.yaml")]
    assert len(runs) >= 2
    for line in runs + ["tandem run --print-config"]:
        args = line.replace("config.yaml", config).split()[1:]
        args = [a.strip('"') for a in args]
        if "--prompt" in args:  # the shell would have joined the quoted prompt
            i = args.index("--prompt") + 1
            j = next((n for n in range(i, len(args)) if args[n].startswith("--")), len(args))
            args[i:j] = [" ".join(args[i:j])]
        res = subprocess.run(
            [TANDEM, *args], text=True, capture_output=True, timeout=240, cwd=tmp_path
        )
        assert res.returncode == 0, (line, res.stderr[-3000:])
        assert res.stdout.strip(), line


def test_openai_snippet_runs(config, tmp_path):
    port = launch.free_port()
    log = tmp_path / "serve.log"
    proc = launch.start_serve(
        config,
        f"tcp://127.0.0.1:{launch.free_port()}",
        "--http",
        f"127.0.0.1:{port}",
        "--served-model-name",
        "my-model",
        log_path=log,
    )
    try:
        launch.wait_http(f"http://127.0.0.1:{port}/v1", proc, log)
        code = block("python", "from openai import OpenAI").replace("8000", str(port))
        code += "\nprint(out.choices[0].text)\n"
        res = subprocess.run(
            [sys.executable, "-c", code], text=True, capture_output=True, timeout=120, cwd=tmp_path
        )
        assert res.returncode == 0, res.stderr[-3000:]
        if shutil.which("curl"):  # the same request without the openai package
            command = block("bash", "curl ").replace("8000", str(port))
            res = subprocess.run(
                ["bash", "-c", command], text=True, capture_output=True, timeout=60
            )
            assert json.loads(res.stdout)["choices"][0]["text"], res.stdout + res.stderr
    finally:
        assert launch.stop(proc) == 0
