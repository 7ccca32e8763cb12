"""Guards of speed that need no clock (issue 51): what a step does, counted. Speed broke
silently before (the first token of a request left a round late; a batch of short prompts
was prefilled over two steps, out of phase), and a timed unit test would not have seen it on
a busy CI host; these counts would have. Each test says what it guards:

- steps and rounds before a request's first token leaves (the prefill's events go out
  before the step's round is sent: runtime.serving.executor.run_step);
- prefill commands per prompt for the default budget of each device type
  (runtime.config.schema.PREFILL_BUDGETS);
- control messages per round, and their bytes on the wire;
- host reads (synchronisations on a GPU) in one worker round.

A bound here moves only with a change that says why (and a benchmark that shows it pays)."""

from __future__ import annotations

import pytest
import torch

from runtime.config import load_config
from runtime.config.schema import PREFILL_BUDGETS
from runtime.control import commands, protocol
from runtime.serving.executor import run_step
from runtime.serving.sequence import EventKind
from tests.serving_sim import Run, make_seq

pytestmark = pytest.mark.timeout(120)

HOST_READS_PER_ROUND = 1  # the verdict (runtime.worker.round._verdict_to_all)


def _run(budget: int | None, **kwargs) -> Run:
    run = Run(num_blocks=4096, num_slots=8, max_prefill_tokens=budget, **kwargs)
    run.workers.lookahead = run.sched.lookahead
    return run


class Ledger:
    """What the workers were sent, in order, and the events delivered early (with the
    number of round commands sent by then)."""

    def __init__(self, run: Run):
        self.sent: list[commands.Command] = []
        self.early: list[tuple[str, list[int], int]] = []  # request, tokens, rounds by then
        self.run = run
        workers = run.workers
        command = workers.command

        def record(cmd, timeout_s):
            self.sent.append(cmd)
            return command(cmd, timeout_s)

        workers.command = record  # type: ignore[method-assign]

    def step(self) -> list:
        def early(events):
            rounds = sum(isinstance(c, commands.RoundCommand) for c in self.sent)
            for e in events:
                if e.kind is EventKind.DELTA and e.token_ids:
                    self.early.append((e.seq.request_id, list(e.token_ids), rounds))

        return run_step(self.run.sched, self.run.executor, early)

    def names(self) -> list[str]:
        return [c.NAME for c in self.sent]


def test_a_batch_of_short_prompts_starts_in_one_step_and_their_first_tokens_leave_first():
    """8 prompts of 32 tokens (256 in all, over the CPU's budget of 128) on an idle engine:
    one prefill command holds all 8, and all 8 first tokens are delivered before the first
    round is sent (d6b1649 sent two prefills over two steps, and every first token only
    after its step's round)."""
    run = _run(PREFILL_BUDGETS["cpu"])
    ledger = Ledger(run)
    for i in range(8):
        run.add(make_seq(f"r{i}", [100 + i * 40 + j for j in range(32)], 20))
    ledger.step()
    assert ledger.names() == ["prefill", "round"]
    assert len(ledger.sent[0].slots) == 8  # type: ignore[attr-defined]
    assert sorted(r for r, _, _ in ledger.early) == [f"r{i}" for i in range(8)]
    assert all(len(tokens) == 1 and rounds == 0 for _, tokens, rounds in ledger.early)


def test_a_request_joining_a_decoding_batch_gets_its_first_token_before_the_round():
    run = _run(PREFILL_BUDGETS["cpu"])
    ledger = Ledger(run)
    run.add(make_seq("busy", list(range(10, 20)), 60))
    ledger.step()
    ledger.step()
    rounds_before = ledger.names().count("round")
    run.add(make_seq("new", list(range(30, 50)), 10))
    ledger.step()
    assert ledger.names()[-2:] == ["prefill", "round"]
    new = [(tokens, rounds) for r, tokens, rounds in ledger.early if r == "new"]
    assert new == [(new[0][0], rounds_before)] and len(new[0][0]) == 1


def _prefill_commands(kind: str, prompt_len: int, decoding: bool) -> int:
    """Prefill commands a lone prompt of prompt_len takes with `kind`'s default budget,
    with or without a request decoding meanwhile."""
    config = load_config(
        {
            "draft": {"model": "d", "devices": [0 if kind == "cuda" else "cpu"]},
            "target": {"model": "t", "devices": [0 if kind == "cuda" else "cpu"]},
            "runtime": {"max_seq_len": 9000},
        },
        check_files=False,
        check_devices=False,
    )
    run = _run(config.prefill_budget)
    run.workers.table_len = run.sched.table_len = 9000 + 16
    ledger = Ledger(run)
    if decoding:
        run.add(make_seq("busy", list(range(10, 20)), 4000))
        ledger.step()
    seq = run.add(make_seq("long", [7 + (i % 5000) for i in range(prompt_len)], 2))
    before = ledger.names().count("prefill")
    while not seq.generated:
        ledger.step()
    return ledger.names().count("prefill") - before


@pytest.mark.parametrize(
    "kind,prompt_len,decoding,expected",
    [
        ("cpu", 100, False, 1),
        ("cpu", 3000, False, 24),  # 128-token chunks: a CPU step stays ~2.5 s for a 1B model
        ("cpu", 3000, True, 24),
        ("cuda", 2048, False, 1),  # prompt-2048 in one step, as before the budget
        ("cuda", 2048, True, 1),
        ("cuda", 8000, False, 4),
        ("cuda", 8000, True, 4),
    ],
)
def test_prefill_commands_per_prompt_for_each_device_types_default(
    kind, prompt_len, decoding, expected
):
    assert _prefill_commands(kind, prompt_len, decoding) == expected


def test_a_decoding_step_is_one_command_of_bounded_bytes():
    """Steady decoding: one round command per step, nothing else; the command and the
    leader's reply for 8 rows of k 4 stay within their bytes on the wire (msgpack)."""
    run = _run(PREFILL_BUDGETS["cpu"])
    ledger = Ledger(run)
    for i in range(8):
        run.add(make_seq(f"r{i}", [100 + i] * 12, 200))
    ledger.step()
    ledger.sent.clear()
    replies = []
    command = run.workers.command

    def keep(cmd, timeout_s):
        out = command(cmd, timeout_s)
        replies.append(out)
        return out

    run.workers.command = keep  # type: ignore[method-assign]
    for _ in range(5):
        ledger.step()
    assert ledger.names() == ["round"] * 5
    for cmd, reply in zip(ledger.sent, replies):
        assert len(protocol.encode(cmd)) <= 96, len(protocol.encode(cmd))  # 70-75 now
        leader = next(r for r in reply.values() if r.reports)
        size = len(protocol.encode(protocol.Done(1, 1, leader)))
        assert size <= 256, size  # 180-212 now


def test_a_worker_round_reads_the_host_once(llama_path, monkeypatch):
    """One draft + verify round on one worker (draft and target co-located, greedy) reads
    device memory from the host this often: each such read is a synchronisation on a GPU,
    where the round has one (the verdict). Counted on the CPU by the tensor methods that
    read values out."""
    from runtime.models import load_model
    from runtime.worker.draft_shard import DraftShard
    from runtime.worker.round import RoundParts, speculate
    from runtime.worker.target_shard import TargetShard

    cpu = torch.device("cpu")
    greedy = commands.Sampling(0.0, 0, 1.0, 0)
    shards = [
        cls(load_model(llama_path, torch.float32, cpu), cpu, 4, 64, "tokens", max_step_len=5)
        for cls in (DraftShard, TargetShard)
    ]
    for shard in shards:
        shard.prefill([0, 1], [[5, 6, 7], [8, 9, 10, 11]], [greedy, greedy])
    parts = RoundParts(shards[0], shards[1], None, 0, 0, 0, cpu, "tokens")  # type: ignore[arg-type]
    speculate(parts, [0, 1], 4)  # warm: the first round may set things up
    reads: list[str] = []
    for name in ("tolist", "item", "__bool__", "__int__", "__index__", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    speculate(parts, [0, 1], 4)
    monkeypatch.undo()
    assert len(reads) <= HOST_READS_PER_ROUND, reads
