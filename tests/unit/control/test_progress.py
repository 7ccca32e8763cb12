"""runtime.control.progress: workers' throttled reports, rank 0's account of them (plain
lines and tqdm bars, phases once each and in order, slow ranks named), and the pool passing
the workers' progress messages to it while it waits for their ready."""

from __future__ import annotations

import io
import re
import threading

import pytest
import zmq

from runtime.config import load_config
from runtime.control import protocol
from runtime.control.pool import WorkerPool
from runtime.control.progress import ProgressReporter, StartupDisplay, rank_labels

pytestmark = pytest.mark.timeout(60)

LABELS = {1: "draft + target TP 0/2, cuda:0", 2: "target TP 1/2, cuda:1"}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def progress(rank: int, phase: str, done: int, total: int) -> protocol.Progress:
    return protocol.Progress(rank, phase, done, total)


def plain(clock: Clock | None = None) -> tuple[StartupDisplay, io.StringIO]:
    out = io.StringIO()
    display = StartupDisplay(LABELS, bars=False, stream=out, clock=clock or Clock())
    return display, out


def lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def feed(display: StartupDisplay, *messages: protocol.WorkerMessage | None) -> None:
    for msg in messages:
        display.observe(msg)


# rank 1 loads draft and target (its total grows), captures, and is ready while rank 2
# still loads; rank 2 then captures too
STARTUP = [
    progress(1, "weights", 0, 20),
    progress(2, "weights", 0, 20),
    progress(1, "weights", 20, 20),
    progress(1, "weights", 20, 30),
    progress(2, "weights", 10, 20),
    progress(1, "weights", 30, 30),
    progress(1, "graphs", 0, 4),
    progress(1, "graphs", 4, 4),
    protocol.Ready(1),
    progress(2, "weights", 20, 20),
    progress(2, "graphs", 0, 4),
    None,
    progress(2, "graphs", 4, 4),
    protocol.Ready(2),
]


def test_reporter_throttles_and_sums_its_parts():
    sent, clock = [], Clock()
    reporter = ProgressReporter(sent.append, rank=3, min_interval_s=0.25, clock=clock)
    target = reporter.callback("weights")
    target(0, 10)  # the first report goes out at once
    clock.now += 0.1
    target(1, 10)  # throttled
    clock.now += 0.2
    target(2, 10)
    draft = reporter.callback("weights")
    draft(0, 5)  # throttled, counted in the next one
    target(10, 10)  # a part's end is always sent
    draft(5, 5)
    reporter.callback("graphs")(0, 7)  # another phase: sent at once
    assert [(m.phase, m.done, m.total) for m in sent] == [
        ("weights", 0, 10),
        ("weights", 2, 10),
        ("weights", 10, 15),
        ("weights", 15, 15),
        ("graphs", 0, 7),
    ]
    assert all(m.rank == 3 and isinstance(m, protocol.Progress) for m in sent)
    for msg in sent:
        assert protocol.decode(protocol.encode(msg)) == msg
    with pytest.raises(ValueError, match="unknown startup phase"):
        reporter.callback("compiling")


def test_progress_schema():
    wire = {"type": "progress", "rank": 1, "phase": "weights", "done": 1, "total": 2}
    assert protocol.from_wire(wire) == progress(1, "weights", 1, 2)
    with pytest.raises(protocol.ProtocolError, match="missing field 'total'"):
        protocol.from_wire({k: v for k, v in wire.items() if k != "total"})
    with pytest.raises(protocol.ProtocolError, match="progress.done"):
        protocol.from_wire(dict(wire, done="1"))


def test_plain_lines_each_phase_once_in_order():
    clock = Clock()
    display, out = plain(clock)
    for msg in STARTUP:
        clock.now += 0.5
        display.observe(msg)
    text = lines(out)
    assert [re.sub(r"[\d.]+ s$", "T s", line) for line in text] == [
        "tandem: loading weights (2 workers)",
        "tandem: loading weights: 50/50 tensors in T s",
        "tandem: capturing CUDA graphs (2 workers)",
        "tandem: capturing CUDA graphs: 8/8 graphs in T s",
        "tandem: ready: 2 workers in T s",
    ]
    assert text[-1] == f"tandem: ready: 2 workers in {0.5 * len(STARTUP):.1f} s"
    display.observe(None)
    assert len(lines(out)) == 5  # nothing after ready


def test_no_graphs_phase_without_captures():
    display, out = plain()
    feed(
        display,
        progress(1, "weights", 0, 3),
        progress(2, "weights", 3, 3),
        protocol.Ready(2),
        progress(1, "weights", 3, 3),
        protocol.Ready(1),
    )
    assert [line.split(" in ")[0] for line in lines(out)] == [
        "tandem: loading weights (2 workers)",
        "tandem: loading weights: 6/6 tensors",
        "tandem: ready: 2 workers",
    ]


def test_slow_rank_is_named_with_what_it_does():
    clock = Clock()
    display, out = plain(clock)
    feed(
        display,
        progress(1, "weights", 0, 291),
        progress(2, "weights", 0, 291),
        progress(2, "weights", 112, 291),
    )
    for _ in range(9):  # rank 1 keeps going, rank 2 stalls
        clock.now += 1.0
        display.observe(progress(1, "weights", int(clock.now) - 100, 291))
    assert len(lines(out)) == 1
    clock.now += 1.0
    display.observe(None)
    assert lines(out)[1:] == [
        "tandem: waiting for rank 2 (target TP 1/2, cuda:1): "
        "loading weights 112/291 tensors (no progress for 10 s)"
    ]
    clock.now += 5.0
    display.observe(None)
    assert len(lines(out)) == 2  # at most once per 10 s
    clock.now += 5.0
    display.observe(None)
    assert lines(out)[2].startswith(
        "tandem: waiting for rank 1 (draft + target TP 0/2, cuda:0): loading weights 9/291 tensors"
    )
    assert lines(out)[3].endswith("loading weights 112/291 tensors (no progress for 20 s)")


def test_silent_rank_before_any_report():
    clock = Clock()
    display, out = plain(clock)
    clock.now += 60  # spawning and handshake do not count
    display.observe(progress(1, "weights", 0, 5))
    clock.now += 10
    display.observe(None)
    assert lines(out)[-2:] == [
        "tandem: waiting for rank 1 (draft + target TP 0/2, cuda:0): loading weights 0/5 "
        "tensors (no progress for 10 s)",
        "tandem: waiting for rank 2 (target TP 1/2, cuda:1): nothing reported for 10 s "
        "since it got its config",
    ]


def test_bad_messages_are_dropped():
    display, out = plain()
    feed(
        display,
        progress(1, "compiling", 0, 1),
        progress(1, "weights", 3, 2),
        progress(9, "weights", 0, 1),
        protocol.Ready(9),
        protocol.Heartbeat(1),
    )
    assert lines(out) == []


def test_bars_one_per_phase_in_order():
    out = io.StringIO()
    display = StartupDisplay(LABELS, bars=True, stream=out, clock=Clock())
    feed(display, *STARTUP)
    segments = [s for s in re.split(r"[\r\n]", out.getvalue()) if s.strip()]
    weights = [i for i, s in enumerate(segments) if "loading weights" in s]
    graphs = [i for i, s in enumerate(segments) if "capturing CUDA graphs" in s]
    assert weights and graphs and max(weights) < min(graphs)
    assert "100%" in segments[weights[-1]] and "50/50" in segments[weights[-1]]
    assert "100%" in segments[graphs[-1]] and "8/8" in segments[graphs[-1]]
    assert segments[-1].startswith("tandem: ready: 2 workers in ")
    assert not any(s.startswith("tandem: loading weights (") for s in segments)
    display.close()


def test_slow_notice_in_bar_mode_keeps_the_bar():
    clock = Clock()
    out = io.StringIO()
    display = StartupDisplay(LABELS, bars=True, stream=out, clock=clock)
    feed(display, progress(1, "weights", 1, 4), progress(2, "weights", 1, 4))
    clock.now += 11
    display.observe(None)
    assert "tandem: waiting for rank 1" in out.getvalue()
    feed(
        display,
        progress(1, "weights", 4, 4),
        progress(2, "weights", 4, 4),
        protocol.Ready(1),
        protocol.Ready(2),
    )
    assert out.getvalue().rstrip().splitlines()[-1].startswith("tandem: ready: 2 workers")


def test_for_stderr_chooses_bars_on_a_terminal_only(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", Tty())
    assert StartupDisplay.for_stderr(LABELS, quiet=False)._bars
    assert not StartupDisplay.for_stderr(LABELS, quiet=True)._bars
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert not StartupDisplay.for_stderr(LABELS, quiet=False)._bars


def test_rank_labels():
    cfg = load_config(
        {"draft": {"model": "/d", "devices": [0]}, "target": {"model": "/t", "devices": [0, 1]}},
        check_files=False,
        check_devices=False,
    )
    assert rank_labels(cfg.topology()) == LABELS
    cfg = load_config(
        {
            "draft": {"model": "/d", "devices": ["cpu:0"]},
            "target": {"model": "/t", "devices": ["cpu:1"]},
        },
        check_files=False,
        check_devices=False,
    )
    assert rank_labels(cfg.topology()) == {1: "draft, cpu:0", 2: "target, cpu:1"}


def test_pool_passes_progress_to_the_display_while_waiting_for_ready():
    """Fake workers (DEALER sockets of this process) report, then send ready."""
    context = zmq.Context()
    pool = WorkerPool((1, 2), context, heartbeat_s=0.1, dead_after_s=5.0)
    socks = {}
    for rank in (1, 2):
        socks[rank] = context.socket(zmq.DEALER)
        socks[rank].setsockopt(zmq.LINGER, 0)
        socks[rank].setsockopt(zmq.IDENTITY, f"w{rank}".encode())
        socks[rank].connect(pool.address)

    def workers() -> None:
        for msg in STARTUP:
            if msg is not None:
                socks[msg.rank].send(protocol.encode(msg, pool.key))

    display, out = plain()
    sender = threading.Thread(target=workers, daemon=True)
    try:
        sender.start()
        ready = pool.wait_for(protocol.Ready, 10.0, watch=display.observe)
        sender.join(5)
    finally:
        for sock in socks.values():
            sock.close(0)
        pool.close()
        context.destroy(linger=0)
    assert sorted(ready) == [1, 2]
    assert [line.split(" (")[0].split(":")[1].strip() for line in lines(out)] == [
        "loading weights",
        "loading weights",
        "capturing CUDA graphs",
        "capturing CUDA graphs",
        "ready",
    ]
