"""A started worker serving the step commands from rank 0 until shutdown: each command is
checked, dispatched to this rank's round parts (runtime.worker.round, runtime.worker.cross),
and answered; the announced next round's first work starts once the answer is sent."""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback

from runtime.config import TandemConfig
from runtime.control.commands import (
    Command,
    CrossDraftCommand,
    CrossVerifyCommand,
    PrefillCommand,
    ReleaseCommand,
    Reply,
    RoundCommand,
    RoundReply,
    StepAck,
    StepCommand,
)
from runtime.control.heartbeat import Pulse
from runtime.control.protocol import Done, Error, Heartbeat, Message, ProtocolError, Shutdown
from runtime.worker.control_link import ERROR_GRACE_S, ControlLink
from runtime.worker.cross import draft_cross, verify_cross
from runtime.worker.round import (
    NextWork,
    RoundParts,
    decode_target_only,
    drop_stale_ahead,
    prefill,
    speculate,
    speculate_overlapped,
    work_ahead,
)

log = logging.getLogger("tandem.worker")


class Serving:
    """A started worker: the step commands from rank 0, each run on this rank's round parts
    (runtime.worker.round), until shutdown."""

    def __init__(self, link: ControlLink, config: TandemConfig, parts: RoundParts, pulse: Pulse):
        self.link = link
        self.rank = link.rank
        self.config = config
        self.parts = parts  # what a round touches on this rank
        self.pulse = pulse
        self.next_work: NextWork | None = None  # the announced next round, to start ahead

    # --- serving loop --------------------------------------------------------------------
    def serve(self) -> None:
        silent_s = max(10.0, 10 * self.config.runtime.heartbeat_s)
        while True:
            msg = self.link.recv(silent_s)
            if isinstance(msg, Heartbeat):
                continue
            if isinstance(msg, Shutdown):
                return
            step = msg.step if isinstance(msg, StepCommand) else -1
            self.pulse.active_at = time.monotonic()  # beats at the working pace from its next
            try:
                result = self.handle(msg)
            except Exception as exc:
                # tell the orchestrator first and let it tell the clients before this rank
                # writes a word or exits: under mpirun either may end every rank at once
                self.link.send(
                    Error(self.rank, step, f"rank {self.rank}: {type(exc).__name__}: {exc}")
                )
                self.link.await_shutdown(ERROR_GRACE_S)
                log.error("rank %d step %d failed:\n%s", self.rank, step, traceback.format_exc())
                raise
            self.link.send(Done(self.rank, step, result))
            self.work_ahead()

    def work_ahead(self) -> None:
        """Start the announced next round's first work (runtime.worker.round.work_ahead)."""
        nxt, self.next_work = self.next_work, None
        if nxt is not None:
            failure = work_ahead(self.parts, nxt)
            if failure is not None:
                log.warning(
                    "rank %d: work ahead failed: %s: %s", self.rank, type(failure).__name__, failure
                )

    def handle(self, msg: Message) -> Reply:
        """Dispatch one command: prefill, release, or a round (runtime.worker.round)."""
        if not isinstance(msg, Command):
            raise ProtocolError(f"not a step command: {msg.NAME!r}")
        cmd = msg
        drop_stale_ahead(self.parts, cmd.k if isinstance(cmd, RoundCommand) else None)
        shards = [s for s in (self.parts.draft, self.parts.target) if s is not None]
        max_k = self.config.speculation.max_draft_len
        if isinstance(cmd, CrossDraftCommand):
            if not 1 <= cmd.k <= max_k:
                raise ValueError(f"draft_cross.k must be in 1..{max_k}, got {cmd.k}")
            return draft_cross(self.parts, cmd)
        if isinstance(cmd, CrossVerifyCommand):
            if any(len(p) > max_k for p in cmd.proposals):
                raise ValueError(f"verify_cross: more than {max_k} proposals for a slot")
            return self._with_cached(verify_cross(self.parts, cmd), cmd.slots, shards)
        if isinstance(cmd, ReleaseCommand):
            for shard in shards:
                shard.release(cmd.slots)
            return StepAck()
        if isinstance(cmd, PrefillCommand):
            result = prefill(
                self.parts, cmd.slots, cmd.prompts, cmd.params, cmd.cached, cmd.tables, cmd.final
            )
            return self._with_cached(result, cmd.slots, shards)
        self._check_round(cmd)
        for shard in shards:
            shard.grow(cmd.slots, cmd.tables)
        if cmd.k == 0:
            result = decode_target_only(self.parts, cmd.slots, cmd.steps)
        elif self.parts.overlap:
            result = speculate_overlapped(self.parts, cmd.slots, cmd.k, cmd.next_k)
        else:
            result = speculate(self.parts, cmd.slots, cmd.k)
        if self.config.runtime.draft_ahead:  # started by work_ahead once result is sent
            self.next_work = NextWork(cmd.slots, cmd.next_k)
        return self._with_cached(result, cmd.slots, shards)

    @staticmethod
    def _with_cached(result: RoundReply, slots: list[int], shards: list) -> RoundReply:
        """The reply with, per slot, the positions every shard of this rank caches (a draft
        with another tokenizer counts its own positions, in its own tables: not reported)."""
        shards = [s for s in shards if not getattr(s, "cross", False)]
        if not shards:
            return result
        cached = [min(column) for column in zip(*(s.cached(slots) for s in shards))]
        return dataclasses.replace(result, cached=cached)

    def _check_round(self, cmd: RoundCommand) -> None:
        """Every number of a round command in its range."""
        max_k, max_len = self.config.speculation.max_draft_len, self.config.runtime.max_seq_len
        if not 0 <= cmd.k <= max_k:
            raise ValueError(f"round.k must be in 0..{max_k}, got {cmd.k}")
        if not 0 <= cmd.next_k <= max_k:
            raise ValueError(f"round.next_k must be in 0..{max_k}, got {cmd.next_k}")
        if cmd.k == 0 and not 1 <= cmd.steps <= max_len:
            raise ValueError(
                f"round.steps of a target-only round must be in 1..{max_len}, got {cmd.steps}"
            )
