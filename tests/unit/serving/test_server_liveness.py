"""The serving loop (runtime.serving.server) over its client door, with an orchestrator whose
steps sleep past every liveness threshold: a long step silences neither a client nor the
server, and every path that ends a request tells its client, streamed or not.

The thresholds are made short here (client timeout, dead_after_s); the defaults stay."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
import zmq

from runtime.api.client import Client
from runtime.control import protocol
from runtime.errors import EngineDeadError, RequestCancelledError
from runtime.params import SamplingParams
from runtime.serving.client_door import ClientDoor
from runtime.serving.sequence import Event, EventKind, SeqStats
from runtime.serving.server import Server

pytestmark = pytest.mark.timeout(60)


@dataclass
class FakeSeq:
    request_id: str
    index: int
    prompt_ids: list[int]
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: SeqStats = field(default_factory=SeqStats)
    params: SamplingParams = field(default_factory=SamplingParams)  # no grammar to compile
    grammar_vocab: str = ""
    error: str = ""

    def output(self) -> dict:
        return {
            "index": self.index,
            "text": "",
            "token_ids": list(self.generated),
            "finish_reason": self.finish_reason,
            "stats": {},
        }


class SlowOrchestrator:
    """Stands in for runtime.serving.orchestrator.Orchestrator: each step sleeps `step_s`
    and then commits one token (the prompt's next id) to every running sequence. `fail`:
    an exception the next step raises."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.seqs: list[FakeSeq] = []
        self.fail: BaseException | None = None
        self.grammar_fails_after: int | None = None  # a sequence's grammar fails at this token
        self.steps = 0
        self.cancelled: list[str] = []

    def info(self) -> dict:
        return {
            "vocab_size": 100,
            "max_seq_len": 64,
            "has_tokenizer": False,
            "model": "fake",
            "server": [socket.gethostname(), os.getpid()],
            "processes": {},
        }

    def make_sequences(
        self, rid, prompts, prompt_ids, params, chat=False, messages=None, tools=None
    ):
        if prompt_ids is None:
            raise ValueError("prompt: this fake takes prompt_token_ids only")
        return [FakeSeq(rid, i, ids, params["max_new_tokens"]) for i, ids in enumerate(prompt_ids)]

    def submit(self, seqs) -> None:
        self.seqs.extend(seqs)

    def cancel(self, rid: str) -> None:
        self.cancelled.append(rid)
        self.seqs = [s for s in self.seqs if s.request_id != rid]

    @property
    def has_work(self) -> bool:
        return bool(self.seqs)

    def step(self, early=None) -> list[Event]:
        time.sleep(self.step_s)
        self.steps += 1
        if self.fail is not None:
            raise self.fail
        events = []
        for seq in list(self.seqs):
            token = (seq.prompt_ids[-1] + len(seq.generated) + 1) % 100
            seq.generated.append(token)
            events.append(Event(EventKind.DELTA, seq, [token], ""))  # type: ignore[arg-type]
            if len(seq.generated) == self.grammar_fails_after:  # as Sequence.fail does
                seq.error = "structured_outputs: the grammar failed after 2 tokens: fuel"
            if len(seq.generated) == seq.max_new_tokens or seq.error:
                seq.finish_reason, seq.stats.t_end = "length", time.perf_counter()
                self.seqs.remove(seq)
                events.append(Event(EventKind.FINAL, seq, [], ""))  # type: ignore[arg-type]
        return events

    def idle(self, timeout_ms: int = 0, wake=()) -> list:
        # at most 0.1 s: the test's stop is an Event, not the signal that wakes a real server
        ready, _, _ = select.select(list(wake), [], [], min(timeout_ms / 1000, 0.1))
        return ready

    def stats(self) -> dict:
        return {"running": len(self.seqs)}

    def metrics_text(self) -> str:
        return ""


class Served:
    """A Server over a SlowOrchestrator on a thread, at a fresh ipc address."""

    def __init__(
        self,
        tmp_path,
        step_s: float,
        client_timeout_s: float = 3.0,
        start: bool = True,
        shutdown_timeout_s: float = 0.0,
    ):
        self.address = f"ipc://{tmp_path}/server.sock"
        self.context = zmq.Context()
        self.door = ClientDoor(self.address, self.context)
        self.orch = SlowOrchestrator(step_s)
        self.client_timeout_s = client_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.stop = threading.Event()
        self.drain = threading.Event()  # SIGTERM's (runtime.control.signals.ServerStop)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        self.server = Server(
            self.orch,
            self.door,
            client_timeout_s=self.client_timeout_s,
            shutdown_timeout_s=self.shutdown_timeout_s,
        )
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.server.serve(self.stop, self.drain)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(10)
        self.door.close()
        self.context.term()


@pytest.fixture
def served(tmp_path):
    made = []

    def make(*args, **kwargs) -> Served:
        made.append(Served(tmp_path, *args, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


class RawClient:
    """A DEALER that sends what it is told and pings never: a client gone silent."""

    def __init__(self, address: str):
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, msg: protocol.Message) -> None:
        self.sock.send(protocol.encode(msg))

    def generate(self, rid: str, max_new_tokens: int = 3, stream: bool = False) -> None:
        self.send(
            protocol.Generate(
                rid, {"max_new_tokens": max_new_tokens}, stream, prompt_ids=[[1, 2, 3]]
            )
        )

    def replies(self, timeout_s: float) -> list[protocol.Message]:
        """Every reply until a terminal one (final or failed), waiting at most timeout_s."""
        out, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                out.append(protocol.decode(self.sock.recv()))
                if isinstance(out[-1], (protocol.Final, protocol.Failed)):
                    return out
        raise AssertionError(f"no terminal reply within {timeout_s} s: {out}")

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()


# --- a long step silences nobody ------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_step_longer_than_every_threshold_still_answers(served, stream):
    """Each step (2.5 s) outlasts the server's client timeout (1 s) and the client's
    dead_after_s (1.5 s): today's main cancelled such a request without a word."""
    s = served(step_s=2.5, client_timeout_s=1.0)
    with Client(s.address, dead_after_s=1.5, ping_s=0.2) as client:
        if stream:
            deltas = list(client.stream(prompt_token_ids=[5, 6], max_new_tokens=2))
            assert [d.token_ids for d in deltas] == [[7], [8]]
        else:
            out = client.generate(prompt_token_ids=[5, 6], max_new_tokens=2)
            assert out.token_ids == [7, 8] and out.finish_reason == "length"
        # and the server is found alive at once afterwards, not judged dead
        assert client.info()["model"] == "fake"
    assert s.orch.cancelled == [] and s.error is None


def test_pings_are_answered_during_a_step(served):
    s = served(step_s=3.0)
    with Client(s.address) as client:
        client.info()
        waiting = threading.Thread(
            target=client.generate, kwargs={"prompt_token_ids": [1], "max_new_tokens": 1}
        )
        waiting.start()
        time.sleep(0.5)  # the step has begun
        start = time.monotonic()
        assert client.info(timeout_s=1.0)["model"] == "fake"
        assert time.monotonic() - start < 0.5
        waiting.join(10)


def test_requests_sent_while_the_workers_load_are_served_once_ready(served):
    s = served(step_s=0.0, start=False)
    with Client(s.address) as client:
        with pytest.raises(EngineDeadError, match="still starting"):
            client.info(timeout_s=0.6)  # `starting`: alive, not ready
        result = {}
        waiting = threading.Thread(
            target=lambda: result.setdefault(
                "out", client.generate(prompt_token_ids=[1], max_new_tokens=1)
            )
        )
        waiting.start()
        time.sleep(0.5)
        s.start()
        waiting.join(10)
        assert result["out"].token_ids == [2]


# --- every end is told ----------------------------------------------------------------------
def test_a_silent_clients_request_is_cancelled_and_told(served):
    s = served(step_s=0.05, client_timeout_s=0.5)
    raw = RawClient(s.address)
    try:
        raw.generate("r1", max_new_tokens=1000)
        reply = raw.replies(5.0)[-1]
        assert isinstance(reply, protocol.Failed) and reply.kind == "cancelled", reply
        assert "sent nothing" in reply.message
    finally:
        raw.close()
    assert s.orch.cancelled == ["r1"]


def test_a_cancel_is_answered(served):
    s = served(step_s=0.05)
    raw = RawClient(s.address)
    try:
        raw.generate("r1", max_new_tokens=1000, stream=True)
        raw.send(protocol.Cancel("r1"))
        reply = raw.replies(5.0)[-1]
        assert isinstance(reply, protocol.Failed) and reply.kind == "cancelled", reply
    finally:
        raw.close()


def test_a_bad_request_is_a_value_error(served):
    s = served(step_s=0.0)
    with Client(s.address) as client:
        with pytest.raises(ValueError, match="prompt_token_ids only"):
            client.generate("text", max_new_tokens=1)


@pytest.mark.parametrize("stream", [False, True])
def test_shutdown_during_a_step_fails_the_request(served, stream):
    s = served(step_s=1.0)
    with Client(s.address) as client:
        threading.Timer(0.3, s.stop.set).start()
        with pytest.raises(EngineDeadError, match="shutting down"):
            if stream:
                list(client.stream(prompt_token_ids=[1], max_new_tokens=50))
            else:
                client.generate(prompt_token_ids=[1], max_new_tokens=50)


@pytest.mark.parametrize(
    "error,match",
    [
        (EngineDeadError("rank 2 died"), "rank 2 died"),
        (RuntimeError("a bug"), "server failed.*a bug"),
    ],
)
def test_a_failing_step_fails_the_request(served, error, match):
    s = served(step_s=0.2)
    s.orch.fail = error
    with Client(s.address) as client:
        with pytest.raises(EngineDeadError, match=match):
            client.generate(prompt_token_ids=[1], max_new_tokens=5)
    s.thread.join(5)
    assert type(s.error) is type(error)


def test_requests_after_serving_ended_are_refused(served):
    s = served(step_s=0.0)
    s.stop.set()
    s.thread.join(5)
    raw = RawClient(s.address)
    try:
        raw.generate("late")
        reply = raw.replies(5.0)[-1]
        assert isinstance(reply, protocol.Failed) and reply.kind == "dead", reply
    finally:
        raw.close()


def test_a_request_ended_by_the_sweep_raises_request_cancelled(served):
    """The Client names a cancellation as such (not as a bad argument)."""
    s = served(step_s=0.05, client_timeout_s=0.5)
    with Client(s.address, ping_s=1000.0) as client:  # it never pings: judged gone
        with pytest.raises(RequestCancelledError, match="sent nothing"):
            client.generate(prompt_token_ids=[1], max_new_tokens=60)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_failing_mid_generation_fails_its_request(served, stream):
    """A sequence whose grammar's matcher failed on a worker (Sequence.error): its request is
    answered with the error (a ValueError naming the argument), the server goes on."""
    s = served(step_s=0.05)
    s.orch.grammar_fails_after = 2
    with Client(s.address) as client:
        with pytest.raises(ValueError, match="^structured_outputs: the grammar failed"):
            if stream:
                list(client.stream(prompt_token_ids=[1], max_new_tokens=5))
            else:
                client.generate(prompt_token_ids=[1], max_new_tokens=5)
        s.orch.grammar_fails_after = None
        assert len(client.generate(prompt_token_ids=[1], max_new_tokens=3).token_ids) == 3
