"""What the control plane's messages cost per round at batch 8 (issue 44, "One schema per
message"): rank 0 encodes a RoundCommand and a PrefillCommand, a worker decodes each into its
typed command, and the two workers' replies (the target leader's verdict, a plain worker's
time) are encoded in their `done` messages and decoded by rank 0 into RoundReply records.
Every frame is HMAC-signed, as under a launch key. Prints the median over N iterations of each
part and of the whole, in microseconds.

    python lab/protocol_bench.py                 # this tree's runtime.control
    python lab/protocol_bench.py --baseline DIR  # DIR/protocol.py and DIR/commands.py of an
                                                 # older commit: dict messages, to_msg/from_map

The baseline of issue 44 is commit 3356c9a (SCHEMAS dicts beside the dataclasses):

    mkdir -p /tmp/base && for f in protocol commands; do
      git show 3356c9a:runtime/control/$f.py > /tmp/base/$f.py; done
    python lab/protocol_bench.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH = 8
K = 4
PROMPT = 64  # tokens per prefilled prompt
BLOCK = 16  # positions per KV block
KEY = b"k" * 32


def load_baseline(directory: str) -> None:
    """Import DIR's protocol.py and commands.py as runtime.control.protocol / .commands."""
    for name in ("protocol", "commands"):
        module = f"runtime.control.{name}"
        spec = importlib.util.spec_from_file_location(module, Path(directory) / f"{name}.py")
        assert spec is not None and spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[module] = loaded
        spec.loader.exec_module(loaded)


def workload(commands, typed: bool):
    """(round command, prefill command, round replies, prefill replies): (rank, reply) each."""
    slots = list(range(BATCH))
    params = {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 3}
    sampling = commands.Sampling(**params) if typed else params
    round_cmd = commands.RoundCommand(slots, K, K, 1, [[100 + s] for s in slots])
    prefill = commands.PrefillCommand(
        slots,
        [[(s * 31 + i) % 32000 for i in range(PROMPT)] for s in slots],
        [sampling] * BATCH,
        [0] * BATCH,
        [[s * 8 + b for b in range(PROMPT // BLOCK)] for s in slots],
        [True] * BATCH,
    )
    leader, worker = commands.TARGET_LEADER, commands.WORKER
    cached = [PROMPT + 5] * BATCH
    round_replies = [
        (1, commands.RoundReply(worker, 0.012, {}, [], [], [], cached)),
        (
            2,
            commands.RoundReply(
                leader, 0.011, {}, [[7, 8, 9, 10, 11]] * BATCH, [4] * BATCH, [], cached
            ),
        ),
    ]
    prefill_replies = [
        (1, commands.RoundReply(worker, 0.05, {}, [], [], [], [PROMPT] * BATCH)),
        (
            2,
            commands.RoundReply(leader, 0.05, {}, [[7]] * BATCH, [0] * BATCH, [], [PROMPT] * BATCH),
        ),
    ]
    return round_cmd, prefill, round_replies, prefill_replies


def step_old(protocol, commands, cmd, replies, step: int) -> None:
    """Dict messages: to_msg + step, check, msgpack; from_msg; to_map / from_map."""
    frame = protocol.encode(dict(cmd.to_msg(), step=step), KEY)
    commands.command(protocol.decode(frame, KEY))
    for rank, reply in replies:
        done = {"type": "done", "rank": rank, "step": step, "result": reply.to_map()}
        frame = protocol.encode(done, KEY)
        commands.RoundReply.from_map(protocol.decode(frame, KEY)["result"])


def step_new(protocol, commands, cmd, replies, step: int) -> None:
    """Typed messages: the pool stamps the step, encode derives the map, decode the record."""
    frame = protocol.encode(dataclasses.replace(cmd, step=step), KEY)
    protocol.decode(frame, KEY)
    for rank, reply in replies:
        frame = protocol.encode(protocol.Done(rank, step, reply), KEY)
        protocol.decode(frame, KEY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="directory with an older protocol.py, commands.py")
    parser.add_argument("-n", type=int, default=10_000, help="iterations (default 10000)")
    args = parser.parse_args()
    if args.baseline:
        load_baseline(args.baseline)
    from runtime.control import commands, protocol

    typed = hasattr(protocol, "Done")
    step = step_new if typed else step_old
    round_cmd, prefill, round_replies, prefill_replies = workload(commands, typed)
    parts: dict[str, list[float]] = {"round": [], "prefill": [], "total": []}
    for i in range(200):  # warm up
        step(protocol, commands, round_cmd, round_replies, i)
        step(protocol, commands, prefill, prefill_replies, i)
    gc.disable()
    clock = time.perf_counter_ns
    for i in range(args.n):
        t0 = clock()
        step(protocol, commands, round_cmd, round_replies, i)
        t1 = clock()
        step(protocol, commands, prefill, prefill_replies, i)
        t2 = clock()
        parts["round"].append((t1 - t0) / 1e3)
        parts["prefill"].append((t2 - t1) / 1e3)
        parts["total"].append((t2 - t0) / 1e3)
    gc.enable()
    what = f"baseline {args.baseline}" if args.baseline else "this tree"
    print(f"{what}: batch {BATCH}, k {K}, prompts of {PROMPT}, N {args.n}; median µs")
    for name, values in parts.items():
        print(f"  {name:8s} {statistics.median(values):8.1f}")


if __name__ == "__main__":
    main()
