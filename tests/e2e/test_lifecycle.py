"""Who owns a launch's processes, and what close() does.

- A server that Engine.launch started ends, with its workers, within 10 s of the program
  that launched it ending: by returning without close(), by an exception, by SIGTERM, by
  SIGKILL, also while the launch is still starting; an Engine that is collected is closed.
  A `tandem serve` a user started outlives the shell that started it.
- close() makes every call waiting in another thread raise EngineClosedError within 1 s;
  later calls raise at once; closing twice is fine. The same for a plain Client, and a
  collected Client is closed.

The out-of-process launches all start at once (fixture `launches`) and load while the
first test launches its own Engine: the file takes about as long as its slowest launch
under that load, not the sum of seven.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest

from runtime import Client, Engine, EngineClosedError, EngineDeadError
from tests import checkpoints, launch
from tests.processes import descendants, kill_all, ranks_of, read, running, wait_gone

pytestmark = pytest.mark.timeout(180)

DEVICES = (("cpu:0",), ("cpu:0",))  # draft and target on one device: server + 1 worker
WORLD = 2
LONG = 1000  # new tokens of a model with no EOS: many seconds
PROMPT = [1, 5, 9, 13]
READY_S = 120  # a launch on two busy cores, six at once
GONE_S = 10  # the bound: owner ended -> no process of its launch
WAKE_S = 1.0  # the bound: close() -> every waiting call raised

# The launching program: launches an Engine, prints its server's pid, then ends as the test
# tells it on stdin: "return" (without close), "raise", "collect" (drops the Engine, then
# waits), or anything else: waits for a signal.
OWNER = r"""
import gc, sys, time, weakref
from runtime import Engine

engine = Engine.launch(sys.argv[1])
print(engine._process.pid, flush=True)
how = sys.stdin.readline().strip()
if how == "raise":
    raise RuntimeError("the program failed")
if how == "collect":
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    for _ in range(100):           # the client's I/O thread may hold it for a moment
        if ref() is None:
            break
        time.sleep(0.01)
    print("collected" if ref() is None else "still referenced", flush=True)
    sys.stdin.readline()
elif how != "return":
    sys.stdin.readline()
"""


class Owner:
    """A program (OWNER) that launches an Engine; every pid of its launch is tracked."""

    def __init__(self, cfg: str, err_path: Path):
        self.err_path = err_path
        with open(err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", OWNER, cfg],
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=launch.clean_env(),
                start_new_session=True,
            )
        self.pids = {self.proc.pid}
        self.server: int | None = None
        self.ranks: dict[int, int] = {}

    def readline(self, timeout_s: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, f"no line from the program within {timeout_s} s:\n{self.stderr()}"
        return self.proc.stdout.readline().strip()

    def wait_ready(self) -> set[int]:
        """The pids of the launch (server and worker), once the Engine is up."""
        line = self.readline(READY_S)
        assert line.isdigit(), f"{line!r}\n{self.stderr()}"
        self.server = int(line)
        launched = set(ranks_of(self.server, WORLD).values())
        assert self.server in launched
        self.pids |= launched
        return launched

    def tell(self, how: str) -> None:
        self.proc.stdin.write(how + "\n")
        self.proc.stdin.flush()

    def stderr(self) -> str:
        return read(self.err_path)[-3000:]

    def close(self) -> None:
        if self.server is not None:
            self.pids |= descendants(self.server)
        kill_all(self.pids)
        self.proc.wait()


class Served:
    """`tandem serve` started the way a user does, from a shell that exits at once."""

    def __init__(self, cfg: str, root: Path):
        self.address = f"ipc://{root}/served.sock"
        self.log = root / "served.log"
        cmd = f"'{sys.executable}' -m launcher serve '{cfg}' --address '{self.address}'"
        shell = subprocess.run(
            ["sh", "-c", f"{cmd} >'{self.log}' 2>&1 & echo $!"],
            capture_output=True,
            text=True,
            timeout=30,
            env=launch.clean_env(),
        )
        self.pid = int(shell.stdout.strip())
        self.pids = {self.pid}

    def wait_ready(self) -> Client:
        client = Client(self.address)
        deadline = time.monotonic() + READY_S
        while True:
            try:
                client.info(timeout_s=2)
                break
            except EngineDeadError:
                assert running(self.pid), f"serve exited:\n{read(self.log)[-3000:]}"
                assert time.monotonic() < deadline, "serve did not start"
        self.pids |= set(ranks_of(self.pid, WORLD).values())
        return client

    def close(self) -> None:
        self.pids |= descendants(self.pid)
        kill_all(self.pids)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("lifecycle")
    # no EOS: every request runs to max_new_tokens, so a long one surely waits
    model = checkpoints.build_checkpoint(
        root / "model", "llama", seed=0, eos_token_id=None, max_position_embeddings=2048
    )
    return launch.write_config(root / "c.yaml", model, model, *DEVICES, max_seq_len=2048)


@pytest.fixture(scope="module")
def launches(cfg, tmp_path_factory):
    """Every out-of-process launch of this file, started at once: the owner programs (by
    how they will end) and a user's `tandem serve`. The worker of the one that will end
    while it starts ("starting") is stopped as soon as it is spawned: that launch cannot
    become ready."""
    root = tmp_path_factory.mktemp("launches")
    owners, served = {}, None
    try:
        for how in ("starting", "return", "raise", "sigterm", "sigkill", "collect"):
            owners[how] = Owner(cfg, root / f"{how}.stderr")
        served = Served(cfg, root)
        starting = owners["starting"]
        starting.ranks = ranks_of(starting.proc.pid, WORLD, timeout_s=READY_S)
        os.kill(starting.ranks[1], signal.SIGSTOP)
        starting.pids |= set(starting.ranks.values())
        yield owners, served
    finally:
        for owner in owners.values():
            owner.close()
        if served is not None:
            served.close()


@pytest.fixture()
def engine(cfg, launches):
    """An Engine in this process (the background launches load meanwhile)."""
    eng = Engine.launch(cfg)
    server = eng._process.pid
    pids = set(ranks_of(server, WORLD).values())
    try:
        yield eng
    finally:
        eng.close()
        kill_all(pids)
    wait_gone(pids, GONE_S)


# --- close() -----------------------------------------------------------------------------
class Caller:
    """Runs one call on a thread; keeps what it raised (or "returned") and when."""

    def __init__(self, call):
        self.outcome: BaseException | str | None = None
        self.at: float | None = None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call) -> None:
        try:
            call()
            self.outcome = "returned"
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            self.outcome = exc
        self.at = time.monotonic()


def assert_woken(callers: dict[str, Caller], closed_at: float) -> None:
    for name, caller in callers.items():
        caller.thread.join(WAKE_S + 1)
        assert isinstance(caller.outcome, EngineClosedError), (name, caller.outcome)
        assert "closed" in str(caller.outcome)
        assert caller.at - closed_at < WAKE_S, (name, caller.at - closed_at)


def assert_calls_raise_at_once(client: Client) -> None:
    calls = {
        "generate": lambda: client.generate(prompt_token_ids=PROMPT, max_new_tokens=2),
        "stream": lambda: next(client.stream(prompt_token_ids=PROMPT, max_new_tokens=2)),
        "info": lambda: client.info(timeout_s=30),
        "stats": lambda: client.stats(timeout_s=30),
    }
    for name, call in calls.items():
        start = time.monotonic()
        with pytest.raises(EngineClosedError, match="is closed"):
            call()
        assert time.monotonic() - start < 0.5, name


def wait_waiting(client: Client, calls: int) -> None:
    """Until `calls` calls wait for replies (the client's table of waiters)."""
    deadline = time.monotonic() + 10
    while len(client._waiters) < calls:
        assert time.monotonic() < deadline, f"{len(client._waiters)} calls wait, not {calls}"
        time.sleep(0.01)


def test_close_wakes_a_waiting_generate_and_stream(engine):
    stream = engine.stream(prompt_token_ids=PROMPT, max_new_tokens=LONG)
    next(stream)  # in flight
    callers = {
        "generate": Caller(lambda: engine.generate(prompt_token_ids=PROMPT, max_new_tokens=LONG)),
        "stream": Caller(lambda: [d for d in stream]),
    }
    wait_waiting(engine, 2)
    closed_at = time.monotonic()
    engine.close()
    assert_woken(callers, closed_at)
    assert engine.closed
    assert_calls_raise_at_once(engine)
    engine.close()  # twice: nothing happens
    assert engine._process.poll() is not None  # close() stopped the server


def test_close_wakes_calls_waiting_for_a_server_that_never_answers(tmp_path):
    """A plain Client, nobody serving its address: info, stats, generate and stream all
    wait (generate and stream for the server's facts first)."""
    client = Client(f"ipc://{tmp_path}/nobody.sock", dead_after_s=60)
    callers = {
        "info": Caller(lambda: client.info(timeout_s=60)),
        "stats": Caller(lambda: client.stats(timeout_s=60)),
        "generate": Caller(lambda: client.generate(prompt_token_ids=PROMPT, max_new_tokens=2)),
        "stream": Caller(lambda: list(client.stream(prompt_token_ids=PROMPT, max_new_tokens=2))),
    }
    wait_waiting(client, 4)
    closed_at = time.monotonic()
    client.close()
    assert_woken(callers, closed_at)
    assert_calls_raise_at_once(client)
    client.close()
    assert not client._thread.is_alive()


def test_a_collected_client_is_closed(tmp_path):
    client = Client(f"ipc://{tmp_path}/nobody.sock")
    ref, thread = weakref.ref(client), client._thread
    del client
    gc.collect()
    deadline = time.monotonic() + 2  # its I/O thread may hold it for a moment
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ref() is None
    thread.join(5)
    assert not thread.is_alive()


# --- ownership ---------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["return", "raise", "sigterm", "sigkill"])
def test_the_server_ends_with_its_owner(launches, how):
    owner = launches[0][how]
    launched = owner.wait_ready()
    start = time.monotonic()
    if how in ("return", "raise"):
        owner.tell(how)
    else:
        owner.proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    code = owner.proc.wait(GONE_S)
    wait_gone(launched, GONE_S - (time.monotonic() - start))
    expected = {"return": 0, "raise": 1, "sigterm": -signal.SIGTERM, "sigkill": -signal.SIGKILL}[
        how
    ]
    assert code == expected, owner.stderr()
    if how == "raise":
        assert "RuntimeError: the program failed" in owner.stderr()


def test_the_server_ends_with_an_owner_killed_while_it_starts(launches):
    """The owner is SIGKILLed while Engine.launch waits for the workers (one is stopped,
    so startup cannot end): the server, which looks at its stop event only once it
    serves, exits all the same (OWNER_GRACE_S after its owner's end), and its workers die
    with it."""
    owner = launches[0]["starting"]
    launched = set(owner.ranks.values())
    assert not select.select([owner.proc.stdout], [], [], 0)[0], "the launch was ready"
    start = time.monotonic()
    owner.proc.send_signal(signal.SIGKILL)
    assert owner.proc.wait(GONE_S) == -signal.SIGKILL
    wait_gone(launched, GONE_S - (time.monotonic() - start))


def test_a_collected_engine_stops_its_server(launches):
    owner = launches[0]["collect"]
    launched = owner.wait_ready()
    owner.tell("collect")
    assert owner.readline(GONE_S) == "collected", owner.stderr()
    wait_gone(launched, GONE_S)
    assert owner.proc.poll() is None  # while the program runs on
    owner.tell("end")
    assert owner.proc.wait(GONE_S) == 0, owner.stderr()


def test_a_users_serve_outlives_its_shell(launches):
    served = launches[1]
    client = served.wait_ready()  # the shell exited long ago
    try:
        assert client.info(timeout_s=10)["max_seq_len"] == 2048
        # a plain Client's close() wakes a real waiting call too
        caller = Caller(lambda: client.generate(prompt_token_ids=PROMPT, max_new_tokens=LONG))
        wait_waiting(client, 1)
        closed_at = time.monotonic()
        client.close()
        assert_woken({"generate": caller}, closed_at)
        with Client(served.address) as again:  # the server serves on
            out = again.generate(prompt_token_ids=PROMPT, max_new_tokens=4)
            assert len(out.token_ids) == 4
    finally:
        client.close()
    os.kill(served.pid, signal.SIGTERM)
    wait_gone(served.pids, 30)
