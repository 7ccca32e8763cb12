"""Startup progress: what the workers load and capture, shown by rank 0 while it waits.

Loading a 70B model's weights (or drawing a synthetic recipe's) and compiling and capturing
its CUDA graphs take minutes. Every worker reports on the control channel while it starts
(runtime.control.protocol.Progress: rank, phase, done, total; at most a few a second, see
ProgressReporter); rank 0 sums the ranks into one account per phase (StartupDisplay):

    loading weights        tensors loaded / total, summed over ranks
    capturing CUDA graphs  graphs captured / total (no CUDA graphs: skipped)
    ready                  every worker has sent ready

On a terminal each phase is one tqdm bar; with --quiet, or when stderr is no terminal
(Engine.launch's server writes to a pipe), one plain line where a phase starts and one where
it ends. A rank that makes no progress for SLOW_S seconds is named with what it is doing.
Phases are shown strictly one after another: a phase ends when every rank is past it (a
rank that hosts draft and target loads both before it captures any graph).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from runtime.control import protocol

if TYPE_CHECKING:
    from parallel.topology import Topology

log = logging.getLogger("tandem.progress")

PHASES = ("weights", "graphs")  # the order every rank goes through, then ready
LABELS = {"weights": "loading weights", "graphs": "capturing CUDA graphs"}
UNITS = {"weights": "tensors", "graphs": "graphs"}
MIN_INTERVAL_S = 0.25  # a worker sends at most 4 progress messages a second
SLOW_S = 10.0  # name a rank that has made no progress for this long
PREFIX = "tandem: "

Progress = Callable[[int, int], None]  # progress(done, total) of one load or capture


def _screen(stream: IO[str]) -> dict:
    """tqdm's ncols and nrows for the terminal behind `stream`. A pseudo-terminal may
    report 0 x 0, which tqdm takes for no room at all: then 80 x 24, as shutil does."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        size = os.terminal_size((0, 0))
    return {
        "ncols": size.columns if size.columns > 0 else 80,
        "nrows": size.lines if size.lines > 0 else 24,
    }


class ProgressReporter:
    """A worker's side: one callback per load or capture (`callback(phase)`); a phase's
    counts are the sums of its callbacks' latest (done, total), sent as one progress
    message at most every `min_interval_s`, and always when a callback reaches its total."""

    def __init__(
        self,
        send: Callable[[protocol.Progress], None],
        rank: int,
        min_interval_s: float = MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._send, self.rank = send, rank
        self._interval, self._clock = min_interval_s, clock
        self._parts: dict[str, list[list[int]]] = {phase: [] for phase in PHASES}
        self._sent_at, self._sent_phase = -math.inf, ""  # phase "": none sent yet

    def callback(self, phase: str) -> Progress:
        if phase not in PHASES:
            raise ValueError(f"unknown startup phase {phase!r}; one of {', '.join(PHASES)}")
        part = [0, 0]
        self._parts[phase].append(part)

        def report(done: int, total: int) -> None:
            part[0], part[1] = int(done), int(total)
            self._report(phase, final=done >= total)

        return report

    def _report(self, phase: str, final: bool) -> None:
        now = self._clock()
        if not final and phase == self._sent_phase and now - self._sent_at < self._interval:
            return
        parts = self._parts[phase]
        done, total = sum(p[0] for p in parts), sum(p[1] for p in parts)
        self._send(protocol.Progress(self.rank, phase, done, total))
        self._sent_at, self._sent_phase = now, phase


def rank_labels(topology: Topology) -> dict[int, str]:
    """rank -> what it hosts and where, e.g. {2: "target TP 1/2, cuda:1"}."""
    sizes = {"draft": len(topology.draft_ranks), "target": len(topology.target_ranks)}
    labels = {}
    for spec in topology.workers:
        parts = []
        for name, tp_rank in (("draft", spec.draft_tp_rank), ("target", spec.target_tp_rank)):
            if tp_rank is not None:
                parts.append(f"{name} TP {tp_rank}/{sizes[name]}" if sizes[name] > 1 else name)
        labels[spec.rank] = f"{' + '.join(parts)}, {spec.device}"
    return labels


@dataclass
class _Rank:
    label: str
    changed_at: float
    stage: int = -1  # index in PHASES of the latest phase reported; len(PHASES): ready
    done: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)
    noticed_at: float = -math.inf


class StartupDisplay:
    """Rank 0's side. `observe` takes every message that arrives while rank 0 waits for the
    workers' ready (None after a quiet poll, so that slow ranks are noticed); `close` ends
    an open bar (startup failed). `bars`: tqdm bars, else plain lines."""

    def __init__(
        self,
        labels: dict[int, str],
        *,
        bars: bool,
        stream: IO[str] | None = None,
        slow_s: float = SLOW_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._clock, self._slow_s, self._bars = clock, slow_s, bars
        self._stream = stream
        self.started_at = clock()
        self._ranks = {rank: _Rank(label, self.started_at) for rank, label in labels.items()}
        self._open: int | None = None  # index of the phase shown now
        self._next = 0  # the next phase that may open
        self._opened_at = self.started_at
        self._bar = None
        self._said_ready = False
        self._watching = False  # observe called yet

    @classmethod
    def for_stderr(cls, labels: dict[int, str], quiet: bool) -> StartupDisplay:
        """Bars when stderr is a terminal and not `quiet`, else plain lines."""
        isatty = getattr(sys.stderr, "isatty", None)
        return cls(labels, bars=not quiet and bool(isatty and isatty()))

    @property
    def stream(self) -> IO[str]:
        return self._stream if self._stream is not None else sys.stderr

    # --- input ---------------------------------------------------------------------------
    def observe(self, msg: protocol.WorkerMessage | None) -> None:
        if not self._watching:  # the workers have their config now: silence counts from here
            self._watching = True
            for state in self._ranks.values():
                state.changed_at = self._clock()
        if isinstance(msg, protocol.Progress):
            self._progress(msg)
        elif isinstance(msg, protocol.Ready):
            self._set_stage(msg.rank, len(PHASES))
        self._advance()
        self._notice_slow()

    def _progress(self, msg: protocol.Progress) -> None:
        rank, phase, done, total = msg.rank, msg.phase, msg.done, msg.total
        if phase not in PHASES or not 0 <= done <= total:
            log.warning("dropped a bad progress message from rank %s: %s", rank, msg)
            return
        state = self._set_stage(rank, PHASES.index(phase))
        if state is not None and (state.done.get(phase), state.total.get(phase)) != (done, total):
            state.done[phase], state.total[phase] = done, total
            state.changed_at = self._clock()

    def _set_stage(self, rank: int, stage: int) -> _Rank | None:
        state = self._ranks.get(rank)
        if state is None:
            log.warning("dropped a progress message from unknown rank %s", rank)
            return None
        if stage > state.stage:
            state.stage, state.changed_at = stage, self._clock()
        return state

    # --- phases --------------------------------------------------------------------------
    def _advance(self) -> None:
        """Close the open phase once every rank is past it, open the next one once a rank
        has reached it (skipping one that every rank passed without a count), say ready."""
        ranks = self._ranks.values()
        while True:
            if self._open is not None:
                if not all(r.stage > self._open for r in ranks):
                    self._update_bar()
                    return
                self._end(self._open)
                self._next, self._open = self._open + 1, None
                continue
            if self._next >= len(PHASES):
                if not self._said_ready and all(r.stage >= len(PHASES) for r in ranks):
                    self._said_ready = True
                    self._line(
                        f"ready: {self._workers()} in {self._clock() - self.started_at:.1f} s"
                    )
                return
            phase = PHASES[self._next]
            if not any(r.stage >= self._next for r in ranks):
                return
            if all(r.stage > self._next for r in ranks) and not self._sum(phase)[1]:
                self._next += 1  # e.g. no CUDA graphs on CPU
                continue
            self._open, self._opened_at = self._next, self._clock()
            self._begin(phase)

    def _workers(self) -> str:
        return f"{len(self._ranks)} worker{'s' if len(self._ranks) != 1 else ''}"

    def _sum(self, phase: str) -> tuple[int, int]:
        ranks = self._ranks.values()
        return sum(r.done.get(phase, 0) for r in ranks), sum(r.total.get(phase, 0) for r in ranks)

    def _begin(self, phase: str) -> None:
        if not self._bars:
            self._line(f"{LABELS[phase]} ({self._workers()})")
            return
        from tqdm import tqdm

        done, total = self._sum(phase)
        self._bar = tqdm(
            total=total,
            initial=done,
            desc=f"{PREFIX}{LABELS[phase]}",
            unit=UNITS[phase].rstrip("s"),
            file=self.stream,
            leave=True,
            **_screen(self.stream),
        )

    def _update_bar(self) -> None:
        if self._bar is None:
            return
        done, total = self._sum(PHASES[self._open])
        if (done, total) != (self._bar.n, self._bar.total):
            self._bar.total = total
            self._bar.update(done - self._bar.n)

    def _end(self, index: int) -> None:
        phase = PHASES[index]
        done, total = self._sum(phase)
        if self._bar is not None:
            self._update_bar()
            self._bar.close()
            self._bar = None
            return
        self._line(
            f"{LABELS[phase]}: {done}/{total} {UNITS[phase]} in "
            f"{self._clock() - self._opened_at:.1f} s"
        )

    # --- slow ranks ----------------------------------------------------------------------
    def _notice_slow(self) -> None:
        """Name each rank that holds the open phase (or readiness) back and has made no
        progress for slow_s, at most once per slow_s."""
        now = self._clock()
        frontier = self._open if self._open is not None else len(PHASES) - 1
        for rank, state in sorted(self._ranks.items()):
            if (
                state.stage > frontier
                or now - state.changed_at < self._slow_s
                or now - state.noticed_at < self._slow_s
            ):
                continue
            state.noticed_at = now
            silent = f"{now - state.changed_at:.0f} s"
            if state.stage < 0:
                doing = f"nothing reported for {silent} since it got its config"
            else:
                phase = PHASES[state.stage]
                doing = (
                    f"{LABELS[phase]} {state.done.get(phase, 0)}/"
                    f"{state.total.get(phase, 0)} {UNITS[phase]} (no progress for {silent})"
                )
            self._line(f"waiting for rank {rank} ({state.label}): {doing}")

    # --- output --------------------------------------------------------------------------
    def _line(self, text: str) -> None:
        if self._bar is not None:
            from tqdm import tqdm

            tqdm.write(PREFIX + text, file=self.stream)
            return
        try:
            self.stream.write(PREFIX + text + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed: progress is no reason to fail
            pass

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
