"""The serving loop of rank 0: the clients' frames (runtime.serving.client_door) <-> the
orchestrator.

The client door's thread reads every frame as it arrives and answers pings, so neither a
client's liveness nor the server's depends on how long one step runs. This loop takes the
frames that wait, runs one step, and sweeps the requests of clients that went silent. An idle
server blocks: one poll over the door's wake-up pipe, the workers' control socket, the local
workers' pidfds and a signal wake-up pipe, until a worker's heartbeat could be too old (the
Beacon's thread reads the heartbeats meanwhile: runtime.control.pool), at most IDLE_WAIT_S.
Every request ends with a terminal reply: `final`, or `failed` with a kind ("value",
"cancelled", "draining" or "dead") and a message, whatever ended it.

A drain (SIGTERM: runtime.control.signals.ServerStop) is a state of this loop: admission
closes (a new request is answered `failed`, kind "draining"; pongs say `draining`, so the
HTTP front's /health answers 503), rounds go on until the last request in flight ends, at
most `shutdown_timeout_s`; what is still running then is failed as on a stop at once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from runtime.control.protocol import (
    Cancel,
    ClientReply,
    ClientRequest,
    Delta,
    Failed,
    Final,
    Generate,
    Metrics,
    MetricsReply,
    Stats,
    StatsReply,
)
from runtime.control.signals import SignalWakeup
from runtime.errors import EngineDeadError
from runtime.serving.client_door import ClientDoor
from runtime.serving.grammars import GrammarService
from runtime.serving.orchestrator import Orchestrator
from runtime.serving.sequence import Event, EventKind, pairs

log = logging.getLogger("tandem.server")
CLIENT_TIMEOUT_S = 10.0  # a client with requests in flight pings every second
MAX_FRAMES_PER_TURN = 1000  # client frames handled between two scheduler steps
COMPILE_POLL_MS = 10  # idle wait while a grammar compiles
IDLE_WAIT_S = 10.0  # longest idle wait: `stop` set by a thread, not a signal, is seen
# this late (the owner watch of launcher.session signals instead)
DRAINING = "the server is shutting down (draining): it takes no new requests"


@dataclass
class Pending:
    identity: bytes
    stream: bool
    seqs: list


class Server:
    def __init__(
        self,
        orch: Orchestrator,
        door: ClientDoor,
        client_timeout_s: float = CLIENT_TIMEOUT_S,
        shutdown_timeout_s: float = 0.0,
    ):
        """Serve the clients at `door` (bound already, answering `starting` until now);
        `shutdown_timeout_s`: how long a drain may take (server.shutdown_timeout_s)."""
        self.orch = orch
        self.door = door
        self.pending: dict[str, Pending] = {}
        self.client_timeout_s = client_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.drain_ends: float | None = None  # while draining: when the drain gives up
        self._last_sweep = time.monotonic()
        self._grammars: GrammarService | None = None  # made by the first structured output
        door.info = orch.info()  # from now on pings get a pong with the server's facts

    def reply(self, identity: bytes, msg: ClientReply) -> None:
        self.door.reply(identity, msg)

    def serve(self, stop: threading.Event, drain: threading.Event | None = None) -> None:
        """Until `stop` is set, or, once `drain` is set, until the requests in flight have
        ended (at most shutdown_timeout_s). Raises EngineDeadError when the workers are
        gone."""
        with SignalWakeup() as wakeup:
            try:
                while not stop.is_set():
                    if drain is not None and drain.is_set() and self.drain_ends is None:
                        self.begin_drain()
                    if self.drained():
                        break
                    self.turn(self.idle_ms(), wakeup)
            except EngineDeadError as exc:
                self.fail_all(str(exc), "dead")
                raise
            except BaseException as exc:  # a bug must not leave a client waiting
                self.fail_all(f"the server failed: {exc!r}", "dead")
                raise
        self.fail_all(self.stop_message(), "dead")

    # --- the drain ------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Admission closes, pongs say so; the requests in flight go on."""
        self.drain_ends = time.monotonic() + self.shutdown_timeout_s
        self.door.info = {**(self.door.info or {}), "draining": True}
        log.info(
            "draining %d request(s), at most %g s (server.shutdown_timeout_s)",
            len(self.pending),
            self.shutdown_timeout_s,
        )

    def drained(self) -> bool:
        """Whether a drain is over: the last request ended, or its time ran out."""
        if self.drain_ends is None:
            return False
        return not self.pending or time.monotonic() >= self.drain_ends

    def idle_ms(self) -> int:
        """The longest idle wait: IDLE_WAIT_S, while draining no later than its end."""
        wait_s = IDLE_WAIT_S
        if self.drain_ends is not None:
            wait_s = min(wait_s, max(0.0, self.drain_ends - time.monotonic()))
        return int(1000 * wait_s)

    def stop_message(self) -> str:
        """Why the requests still in flight when serving ends are failed."""
        if self.drain_ends is not None and time.monotonic() >= self.drain_ends:
            return (
                f"server shutting down: the drain's {self.shutdown_timeout_s:g} s "
                f"(server.shutdown_timeout_s) ran out before this request ended"
            )
        return "server shutting down"

    def fail_all(self, message: str, kind: str) -> None:
        """Serving ends: every request in flight, waiting at the door or still to come is
        answered `failed` with `message`."""
        self.door.refuse(message)
        for rid, pend in list(self.pending.items()):
            self.reply(pend.identity, Failed(rid, message, kind))
        self.pending.clear()

    def turn(self, idle_ms: int, wakeup: SignalWakeup) -> None:
        """What has arrived, but a bounded number of frames (clients that keep sending,
        pings or stats, must not starve the rounds); then one round, or, with nothing to
        run, a wait for the next frame, worker event or signal."""
        for identity, msg in self.door.take(MAX_FRAMES_PER_TURN):
            self.handle(identity, msg)
        if self.door.failure is not None:
            raise EngineDeadError(self.door.failure)
        self.compiled()
        if self.orch.has_work:
            self.dispatch(self.orch.step(early=self.dispatch))  # first tokens before the round
        else:
            compiling = self._grammars is not None and self._grammars.busy
            wait_ms = 0 if self.door.waiting else COMPILE_POLL_MS if compiling else idle_ms
            self.orch.idle(wait_ms, wake=(self.door.wake_fd, *wakeup.fds))
            wakeup.drain()
        self.sweep_clients()

    def handle(self, identity: bytes, msg: ClientRequest) -> None:
        """One client request (checked against its schema by the door; pings it answers)."""
        if isinstance(msg, Cancel):
            if msg.id in self.pending and self.pending[msg.id].identity == identity:
                self.end(msg.id, "the client cancelled the request", "cancelled")
        elif isinstance(msg, Stats):
            self.reply(identity, StatsReply(msg.id, self.orch.stats()))
        elif isinstance(msg, Metrics):
            self.reply(identity, MetricsReply(msg.id, self.orch.metrics_text()))
        elif isinstance(msg, Generate):
            self.admit(identity, msg)
        else:
            log.warning("dropped a client message of type %r", msg.NAME)

    def admit(self, identity: bytes, msg: Generate) -> None:
        rid = msg.id
        if self.drain_ends is not None:
            self.reply(identity, Failed(rid, DRAINING, "draining"))
            return
        try:
            if rid in self.pending:
                raise ValueError(f"request id {rid!r} is already in use")
            seqs = self.orch.make_sequences(
                rid,
                msg.prompts,
                msg.prompt_ids,
                msg.params,
                chat=msg.chat,
                messages=msg.messages,
                tools=msg.tools,
            )
        except (ValueError, TypeError) as exc:
            self.reply(identity, Failed(rid, str(exc), "value", getattr(exc, "param", None)))
            return
        self.pending[rid] = Pending(identity, msg.stream, seqs)
        if seqs[0].params.structured_outputs is None:
            self.orch.submit(seqs)
            return
        if self._grammars is None:
            orch = self.orch
            self._grammars = GrammarService(orch.tokenizer, orch.vocab_size, orch.eos_token_ids)
        self._grammars.submit(rid, seqs)  # compiled off this loop: compiled() submits it

    def compiled(self) -> None:
        """Requests whose grammar compiled go to the scheduler; those whose grammar did not
        are answered with the error naming the argument."""
        if self._grammars is None:
            return
        for rid, seqs, error in self._grammars.finished():
            pend = self.pending.get(rid)
            if pend is None:  # cancelled or swept while compiling
                continue
            if error is not None:
                del self.pending[rid]
                param = getattr(error, "param", None)
                self.reply(pend.identity, Failed(rid, str(error), "value", param))
            else:
                self.orch.submit(seqs)

    def dispatch(self, events: list[Event]) -> None:
        for event in events:
            seq = event.seq
            if seq.grammar_vocab and self._grammars is not None:  # its prefill went through
                self._grammars.delivered = True
            pend = self.pending.get(seq.request_id)
            if pend is None:
                continue
            if seq.error:  # its grammar failed: the request ends with the error (siblings too)
                self.end(seq.request_id, seq.error, "value", "structured_outputs")
                continue
            if event.kind is EventKind.DELTA and pend.stream and (event.token_ids or event.text):
                logprobs = None if event.logprobs is None else pairs(event.logprobs)
                self.reply(
                    pend.identity,
                    Delta(seq.request_id, seq.index, event.token_ids, event.text, logprobs),
                )
            if (
                event.kind is EventKind.FINAL
                and all(s.stats.t_end is not None for s in pend.seqs)  # each one retired
            ):
                del self.pending[seq.request_id]
                self.reply(pend.identity, Final(seq.request_id, [s.output() for s in pend.seqs]))

    def end(self, rid: str, message: str, kind: str, param: str | None = None) -> None:
        """End a request before its final reply: the scheduler drops it, the client is told
        (`param`: the argument at fault, for kind "value")."""
        pend = self.pending.pop(rid)
        self.orch.cancel(rid)
        self.reply(pend.identity, Failed(rid, message, kind, param))

    def sweep_clients(self) -> None:
        """Cancel the requests of clients that stopped pinging (gone without a word). The
        door hears every frame as it arrives, so a long step does not silence a client."""
        now = time.monotonic()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        for rid, pend in list(self.pending.items()):
            seen = self.door.last_seen(pend.identity)
            silent = now - (now if seen is None else seen)
            if silent > self.client_timeout_s:
                log.warning("client silent for %.0f s; cancelling request %s", silent, rid)
                self.end(
                    rid,
                    f"the client sent nothing for {silent:.0f} s (more than "
                    f"{self.client_timeout_s:g} s): cancelled",
                    "cancelled",
                )
        self.door.forget_before(now - 10 * self.client_timeout_s)

    def close(self) -> None:
        if self._grammars is not None:
            self._grammars.close()
        self.door.close()
