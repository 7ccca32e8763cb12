"""Run tandem through each launch form in its own process group, with a hard timeout, and
check that nothing is left running afterwards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from launcher import discovery

FORMS = ("spawn", "torchrun", "mpirun", "mpi-spawn")
BIN = Path(sys.executable).parent


def write_config(
    path: Path,
    draft: str,
    target: str,
    draft_devices=("cpu:0",),
    target_devices=("cpu:1",),
    draft_len: int = 4,
    **runtime,
) -> str:
    config = {
        "draft": {"model": draft, "devices": list(draft_devices), "dtype": "float32"},
        "target": {"model": target, "devices": list(target_devices), "dtype": "float32"},
        "speculation": {"draft_len": draft_len, "acceptance": "tokens"},
        "runtime": {"max_batch_size": 4, "max_seq_len": 256, **runtime},
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


def set_speculation(path: str | Path, **values) -> None:
    """Set keys of the `speculation` section of the config file at `path`."""
    config = yaml.safe_load(Path(path).read_text())
    config.setdefault("speculation", {}).update(values)
    Path(path).write_text(yaml.safe_dump(config))


def free_port() -> int:
    return discovery.free_port()


def world_size(draft_devices, target_devices) -> int:
    return 1 + len(dict.fromkeys([*draft_devices, *target_devices]))


def command(form: str, world: int, args: list[str], mpi_args: tuple[str, ...] = ()) -> list[str]:
    """The command line of one launch form; `mpi_args` go to mpirun (e.g.
    "-disable-auto-cleanup")."""
    if form == "spawn":
        return [sys.executable, "-m", "launcher", *args]
    if form == "torchrun":
        return [
            str(BIN / "torchrun"),
            "--standalone",
            f"--nproc-per-node={world}",
            "-m",
            "launcher",
            *args,
        ]
    if form == "mpirun":
        return [_mpirun(), *mpi_args, "-n", str(world), sys.executable, "-m", "launcher", *args]
    if form == "mpi-spawn":
        return [_mpirun(), *mpi_args, "-n", "1", sys.executable, "-m", "launcher", *args]
    raise ValueError(form)


def _mpirun() -> str:
    local = BIN / "mpirun"
    return str(local) if local.exists() else shutil.which("mpirun")


def clean_env() -> dict:
    env = dict(os.environ)
    for key in list(env):
        if key.startswith(("PMI_", "OMPI_", "PMIX_", "MPI_", "TORCHELASTIC")) or key in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TANDEM_API_KEY",  # a key of the user's would guard the test servers' HTTP API
        ):
            env.pop(key)
    env["OMP_NUM_THREADS"] = "1"
    return env


def run(
    form: str, world: int, args: list[str], timeout: float = 180
) -> subprocess.CompletedProcess:
    """Run one launch form to completion (or kill it at `timeout`); assert no process is left."""
    proc = subprocess.Popen(
        command(form, world, args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=clean_env(),
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{form} timed out after {timeout} s\n{err[-4000:]}") from None
    assert_group_gone(proc.pid)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_group_gone(pgid: int, grace_s: float = 10.0) -> None:
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)
    raise AssertionError(f"processes of group {pgid} were still running")


def run_json(form: str, world: int, args: list[str], timeout: float = 180) -> list[dict]:
    """One JSON object per prompt, in prompt order."""
    res = run(form, world, [*args, "--json"], timeout)
    assert res.returncode == 0, f"{form} exited {res.returncode}\n{res.stderr[-4000:]}"
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


# --- a `tandem serve` of a test: started, waited for over HTTP, stopped --------------------
def start_serve(cfg: str, address: str, *args: str, log_path) -> subprocess.Popen:
    """`tandem serve CFG --address ADDRESS ARGS...` (spawn launch) in its own process group,
    its output to log_path."""
    env = dict(clean_env(), TANDEM_LAUNCH="spawn")
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "launcher", "serve", cfg, "--address", address, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )


def wait_http(
    url: str, proc: subprocess.Popen, log_path, timeout_s: float = 180, context=None
) -> None:
    """Until the HTTP front at `url` (with or without /v1) answers /health; AssertionError
    with the log's tail when the server exits or timeout_s passes. `context`: the
    ssl.SSLContext of an https `url`."""
    deadline = time.monotonic() + timeout_s
    health = url.removesuffix("/v1") + "/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"server exited {proc.returncode}:\n{open(log_path).read()[-4000:]}"
            )
        try:
            with urllib.request.urlopen(health, timeout=2, context=context) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"HTTP front not up after {timeout_s} s:\n{open(log_path).read()[-4000:]}")


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> int:
    """SIGTERM (unless it has ended) and its exit code; killed and AssertionError when it
    is not gone within timeout_s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"server did not stop within {timeout_s} s of SIGTERM") from None
