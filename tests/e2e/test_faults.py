"""Faults through the launch forms: dead, stopped and failing ranks, a dead orchestrator,
startup failures and shutdown signals. Every case asserts a time bound and that no process
is left behind (all processes of a launch are tracked by pid and killed in `finally`).

Detection bounds (runtime/pool.py, runtime/worker.py, launcher/bootstrap.py):
- a rank that dies: its peers' collectives fail at once and report the error; the
  orchestrator names the rank that died (a child that exited, a process of this host that is
  gone) -> EngineDeadError well within a second;
- a rank that stops (SIGSTOP) or hangs with its heartbeat thread: no heartbeat for
  max(10 s, 10 * runtime.heartbeat_s) -> EngineDeadError naming it;
- a rank that still heartbeats but is stuck in a collective (here: the peer of a stopped
  rank): the groups' timeout and the orchestrator's wait for a step are
  runtime.step_timeout_s, so that bounds it (test_step_timeout_bounds_a_stuck_collective);
- the orchestrator gone: spawned workers die with it (PR_SET_PDEATHSIG); pre-started ranks
  exit when torchrun/mpirun tear the job down, or when the beacon has been silent for the
  heartbeat bound.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from runtime import Client, Engine, EngineDeadError
from tests import checkpoints, launch
from tests.processes import descendants, kill_all, ranks_of, read, wait_gone

pytestmark = pytest.mark.timeout(150)

DRAFT = ("cpu:0",)
TARGET = ("cpu:1",)
W = 3  # orchestrator + draft worker + target worker
LONG = 1500  # new tokens: keeps a request in flight for seconds
PROMPT = [1, 5, 9, 13]
DRAIN_GOAL_S = 12.0  # a drain under torchrun: longer than the workers' SIGNAL_GRACE_S (5 s)


# --- models and configs ------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    # no EOS: every request runs to max_new_tokens, so it is surely in flight when we strike
    target = checkpoints.build_checkpoint(
        root / "target", "llama", seed=0, eos_token_id=None, max_position_embeddings=2048
    )  # max_seq_len below
    draft = checkpoints.build_near_draft(target, root / "draft", noise=0.05)
    # valid config.json (config validation passes), weights file cut in half: loading fails
    broken = root / "broken"
    broken.mkdir()
    shutil.copy(Path(draft) / "config.json", broken / "config.json")
    data = (Path(draft) / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    return {"target": target, "draft": draft, "broken": str(broken)}


def config(
    models, tmp_path, draft="draft", target="target", devices=(DRAFT, TARGET), **runtime
) -> str:
    return launch.write_config(
        tmp_path / "c.yaml", models[draft], models[target], *devices, max_seq_len=2048, **runtime
    )


# --- `tandem serve` under a launch form ---------------------------------------------------
class Served:
    """`tandem serve` under one launch form, in its own session, stderr to a file."""

    def __init__(
        self,
        form: str,
        world: int,
        cfg: str,
        mpi_args: tuple[str, ...] = (),
        args: tuple[str, ...] = (),
    ):
        """`args`: more of serve's options."""
        self.form, self.world = form, world
        self.dir = Path(tempfile.mkdtemp(prefix="tandem-faults-"))
        self.address = f"ipc://{self.dir}/server.sock"
        self.err_path = self.dir / "stderr.txt"
        serve = ["serve", cfg, "--address", self.address, *args]
        cmd = launch.command(form, world, serve, mpi_args)
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdout=err,
                stderr=err,  # hydra: stdout
                start_new_session=True,
                env=launch.clean_env(),
            )
        self.pids: set[int] = {self.proc.pid}
        self.ranks: dict[int, int] = {}
        self.client: Client | None = None

    def wait_ready(self, timeout_s: float = 120) -> Client:
        self.client = Client(self.address, dead_after_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.client.info(timeout_s=2)
                break
            except EngineDeadError:
                assert self.proc.poll() is None, (
                    f"{self.form} serve exited {self.proc.returncode}:\n{self.stderr()[-3000:]}"
                )
                assert time.monotonic() < deadline, f"{self.form} serve did not start"
        self.ranks = ranks_of(self.proc.pid, self.world)
        self.pids |= descendants(self.proc.pid) | set(self.ranks.values())
        self.client.dead_after_s = 10.0  # from now on, silence is death
        return self.client

    def stderr(self) -> str:
        return read(self.err_path)

    def wait_exit(self, timeout_s: float) -> tuple[int, float]:
        start = time.monotonic()
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.form} did not exit within {timeout_s} s:\n{self.stderr()[-3000:]}"
            ) from None
        return code, time.monotonic() - start

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.pids |= descendants(self.proc.pid)
        kill_all(self.pids)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        wait_gone(self.pids, 10)
        shutil.rmtree(self.dir, ignore_errors=True)


def in_flight(client: Client, deltas: int = 2):
    """A streaming request that has produced `deltas` deltas and is still running."""
    stream = client.stream(prompt_token_ids=PROMPT, max_new_tokens=LONG)
    for _ in range(deltas):
        next(stream)
    return stream


def drain(stream) -> tuple[float, str]:
    """(seconds until the stream raised EngineDeadError, its message); fails if the stream
    finishes instead."""
    start = time.monotonic()
    with pytest.raises(EngineDeadError) as info:
        for _ in stream:
            pass
    return time.monotonic() - start, str(info.value)


@contextlib.contextmanager
def launched(cfg: str):
    """Engine.launch(cfg), its server's ranks found (rank -> pid) and every pid tracked: yields
    (engine, ranks, pids); afterwards the engine is closed, anything left is killed and, if
    the test passed, the server's process group must be gone."""
    engine = Engine.launch(cfg)
    server = engine._process.pid
    pids = {server}
    try:
        ranks = ranks_of(server, W)
        pids |= set(ranks.values())
        yield engine, ranks, pids
    finally:
        engine.close()
        kill_all(pids)
    launch.assert_group_gone(server)


# --- 1. a dead worker --------------------------------------------------------------------
@pytest.mark.parametrize("victim", [1, 2], ids=["draft-rank", "target-rank"])
def test_engine_killed_worker_mid_request(victim, models, tmp_path):
    with launched(config(models, tmp_path)) as (engine, ranks, pids):
        stream = in_flight(engine)
        os.kill(ranks[victim], signal.SIGKILL)
        took, error = drain(stream)
        assert took < 10, took
        assert f"rank {victim} (pid {ranks[victim]}) was killed by SIGKILL" in error, error
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            engine.generate(prompt_token_ids=PROMPT, max_new_tokens=4)
        assert time.monotonic() - start < 10  # at the latest when the server exits
        assert engine._process.wait(30) == 1
        start = time.monotonic()  # gone: calls fail at once
        with pytest.raises(EngineDeadError):
            engine.generate(prompt_token_ids=PROMPT, max_new_tokens=4)
        assert time.monotonic() - start < 1
        wait_gone(pids, 30)


@pytest.mark.parametrize("form", ["torchrun", "mpirun"])
def test_serve_killed_worker_under_launcher(form, models, tmp_path):
    """torchrun: rank 0 names the dead rank to the client and on stderr. mpirun runs with
    -disable-auto-cleanup (README): without it MPICH's hydra SIGKILLs every rank ~0.1 s
    after one dies; with it, it still may as soon as it reaps a rank killed by a signal, so
    rank 0 names the rank when it wins that race (most runs); when it loses, the client
    names it: it watches the server's processes on its host and sees which died first."""
    mpi_args = ("-disable-auto-cleanup",) if form == "mpirun" else ()
    served = Served(form, W, config(models, tmp_path), mpi_args)
    try:
        client = served.wait_ready()
        victim = served.ranks[2]
        stream = in_flight(client)
        os.kill(victim, signal.SIGKILL)
        code, took = served.wait_exit(30)
        assert code != 0
        wait_gone(served.pids, 30)
        err = served.stderr()
        named = f"rank 2 (pid {victim}) died"
        took, error = drain(stream)
        if form == "torchrun":
            assert named in err, err[-3000:]  # tandem's rank 0
            assert re.search(r"rank\s*: 2 \(local_rank: 2\)\s*\n\s*exitcode\s*: -9", err)
            assert took < 10 and named in error, error
        else:
            # rank 0 names it when it wins the race with hydra; else the client, which
            # watches the server's local processes, does
            assert named in error, (error, err[-3000:])
            assert took < 10
            print(
                f"mpirun: {'the client' if 'before it reported' in error else 'rank 0'} "
                f"named the dead rank ({took:.1f} s)"
            )
    finally:
        served.close()


def test_run_killed_worker_exits_1_naming_it(models, tmp_path):
    """`tandem run` (spawn) whose target worker dies mid-generation: the draft rank's
    collective raises and reports; rank 0 names the dead rank and exits 1."""
    err_path = tmp_path / "stderr.txt"
    cmd = launch.command(
        "spawn",
        W,
        [
            "run",
            config(models, tmp_path),
            "--prompt-ids",
            "1,5,9,13",
            "--max-new-tokens",
            str(LONG),
            "--json",
        ],
    )
    env = dict(launch.clean_env(), TANDEM_LOG="INFO")
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True, env=env
        )
    pids = {proc.pid}
    try:
        deadline = time.monotonic() + 120
        while "workers ready" not in read(err_path):
            assert proc.poll() is None, read(err_path)[-3000:]
            assert time.monotonic() < deadline, "tandem run did not start"
            time.sleep(0.1)
        ranks = ranks_of(proc.pid, W)
        pids |= set(ranks.values())
        time.sleep(0.5)  # generating now
        os.kill(ranks[2], signal.SIGKILL)
        start = time.monotonic()
        out, _ = proc.communicate(timeout=30)
        assert time.monotonic() - start < 30
        assert proc.returncode == 1 and out == ""
        err = read(err_path)
        assert f"engine died: rank 2 (pid {ranks[2]}) was killed by SIGKILL" in err, err
        wait_gone(pids, 30)
    finally:
        kill_all(pids)
        proc.wait()
    launch.assert_group_gone(proc.pid)


# --- 2. a dead orchestrator --------------------------------------------------------------
def test_killed_engine_server_takes_the_workers_down(models, tmp_path):
    """SIGKILL of `tandem serve` (spawned by Engine.launch) mid-request: the workers die with
    it (PR_SET_PDEATHSIG), the pending call raises at once (the Engine sees its process go)."""
    with launched(config(models, tmp_path)) as (engine, ranks, pids):
        server = engine._process.pid
        stream = in_flight(engine)
        os.kill(server, signal.SIGKILL)
        took, error = drain(stream)
        assert took < 5 and f"(pid {server}) exited with code -9" in error, error
        assert wait_gone(pids, 30) < 30


@pytest.mark.parametrize("form", ["torchrun", "mpirun"])
def test_killed_rank0_takes_the_other_ranks_down(form, models, tmp_path):
    served = Served(form, 2, config(models, tmp_path, devices=(DRAFT, DRAFT)))
    try:
        served.wait_ready()
        rank0 = served.ranks[0]
        os.kill(rank0, signal.SIGKILL)
        assert wait_gone(served.pids - {rank0}, 30) < 30
        code, _ = served.wait_exit(30)
        assert code != 0
    finally:
        served.close()


# --- 3. a hung rank ----------------------------------------------------------------------
def test_engine_stopped_worker_is_dead_within_heartbeat_bound(models, tmp_path):
    with launched(config(models, tmp_path)) as (engine, ranks, pids):
        stream = in_flight(engine)
        os.kill(ranks[1], signal.SIGSTOP)
        took, error = drain(stream)
        assert 5 < took < 15, (took, error)  # heartbeat bound: 10 s
        assert "rank 1 sent no heartbeat" in error, error
        with pytest.raises(EngineDeadError):
            engine.generate(prompt_token_ids=PROMPT, max_new_tokens=4)
        assert engine._process.wait(30) == 1
        wait_gone(pids, 30)  # the stopped worker was killed too


def test_step_timeout_bounds_a_stuck_collective(models, tmp_path):
    """The target rank keeps heartbeating while it waits in a collective for the stopped
    draft rank: runtime.step_timeout_s (here 3 s) ends the step well before the 10 s
    heartbeat bound, and the error names the stopped rank."""
    with launched(config(models, tmp_path, step_timeout_s=3.0)) as (engine, ranks, pids):
        stream = in_flight(engine)
        os.kill(ranks[1], signal.SIGSTOP)
        took, error = drain(stream)
        assert 2 < took < 8, (took, error)
        assert "rank 1 sent no heartbeat" in error, error
        assert engine._process.wait(30) == 1
        wait_gone(pids, 30)


# --- 4. startup failures -----------------------------------------------------------------
def test_run_with_unloadable_checkpoint_exits_1(models, tmp_path):
    cfg = config(models, tmp_path, draft="broken", devices=(DRAFT, DRAFT))
    start = time.monotonic()
    res = launch.run("spawn", 2, ["run", cfg, "--prompt-ids", "1,2,3"], timeout=120)
    assert time.monotonic() - start < 90
    assert res.returncode == 1, res.stderr[-3000:]
    assert "rank 1 failed to load: SafetensorError" in res.stderr, res.stderr[-3000:]
    assert res.stdout == ""


def test_engine_launch_with_unloadable_checkpoint_raises(models, tmp_path, capfd):
    """The server's own error line reaches the EngineDeadError (and its stderr ours), as
    soon as the server exits: long before runtime.startup_timeout_s."""
    cfg = config(
        models,
        tmp_path,
        target="broken",
        draft="broken",
        devices=(DRAFT, DRAFT),
        startup_timeout_s=600,
    )
    before = set(descendants(os.getpid()))
    start = time.monotonic()
    with pytest.raises(EngineDeadError) as info:
        Engine.launch(cfg)
    assert time.monotonic() - start < 60
    message = str(info.value)
    assert "exited with code 1: rank 1 failed to load: SafetensorError" in message, message
    assert "rank 1 failed to load" in capfd.readouterr().err
    wait_gone(descendants(os.getpid()) - before, 10)


# --- 5. shutdown by signal ---------------------------------------------------------------
@pytest.mark.parametrize(
    "sig,busy",
    [(signal.SIGTERM, True), (signal.SIGINT, False)],
    ids=["SIGTERM-busy", "SIGINT-idle"],
)  # each signal, each state
def test_serve_stops_on_signal(sig, busy, models, tmp_path):
    """SIGTERM to `tandem serve` (kill) with no drain (--shutdown-timeout 0: the drains are
    tests/e2e/test_drain.py's and the torchrun test's below); SIGINT to its whole process
    group (Ctrl-C in a terminal: the workers get it too and wait for the orchestrator's
    shutdown)."""
    cfg = config(models, tmp_path, devices=(DRAFT, DRAFT))
    served = Served("spawn", 2, cfg, args=("--shutdown-timeout", "0"))
    try:
        client = served.wait_ready()
        stream = in_flight(client) if busy else None
        if sig == signal.SIGINT:
            os.killpg(served.proc.pid, sig)
        else:
            os.kill(served.proc.pid, sig)
        if stream is not None:
            try:
                for _ in stream:
                    pass
            except EngineDeadError as exc:
                assert "shutting down" in str(exc)
        code, took = served.wait_exit(30)
        assert code == 0, served.stderr()[-3000:]
        wait_gone(served.pids, 30)
        assert "Traceback" not in served.stderr(), served.stderr()[-3000:]
    finally:
        served.close()


def test_torchrun_serve_drains_on_sigterm(models, tmp_path):
    """SIGTERM to torchrun: it forwards SIGTERM to every rank (and SIGKILLs them 30 s later,
    its --shutdown-timeout); rank 0 drains, the signalled workers serve on until its
    shutdown (their grace: runtime.worker.control_link), the request in flight ends whole
    (made to run about DRAIN_GOAL_S, past the workers' own SIGNAL_GRACE_S, on this host
    now), and every rank exits. torchrun itself then re-raises the signal (SignalException,
    exit 1): that code is torchrun's, not ours."""
    served = Served("torchrun", W, config(models, tmp_path), args=("--shutdown-timeout", "25"))
    try:
        client = served.wait_ready()
        start = time.monotonic()
        client.generate(prompt_token_ids=PROMPT, max_new_tokens=32)
        rate = 32 / (time.monotonic() - start)
        tokens = max(32, min(LONG, int(rate * DRAIN_GOAL_S)))
        stream = client.stream(prompt_token_ids=PROMPT, max_new_tokens=tokens)
        got = len(next(stream).token_ids)
        signalled = time.monotonic()
        os.kill(served.proc.pid, signal.SIGTERM)
        got += sum(len(d.token_ids) for d in stream)
        drained = time.monotonic() - signalled
        assert got == tokens, (got, tokens)
        code, took = served.wait_exit(30)
        wait_gone(served.pids, 30)
        err = served.stderr()
        assert "got signal: 15" in err, err[-3000:]
        for bad in ("ChildFailedError", "engine died", "crashed"):
            assert bad not in err, err[-3000:]
        print(f"{tokens} tokens, drained {drained:.1f} s after SIGTERM")
    finally:
        served.close()
