"""Overlapped rounds (runtime.worker.overlap) in one process: both shards on the CPU, the
bridge a no-op. Greedy output (and sampled output under `acceptance: tokens`) must be the
target's own token for token whatever the draft,
with rows of one batch kept and rejected in the same round, k changing between rounds and a
sequence joining while others hold next windows."""

from __future__ import annotations

import pytest
import torch

from runtime.control.commands import Sampling
from runtime.models import load_model
from runtime.worker.draft_shard import DraftShard
from runtime.worker.round import RoundParts, speculate_overlapped
from runtime.worker.target_shard import TargetShard
from tests.checkpoints import build_checkpoint, build_near_draft

pytestmark = pytest.mark.timeout(180)

CPU = torch.device("cpu")
GREEDY = Sampling(0.0, 0, 1.0, 0)
SAMPLED = Sampling(1.0, 0, 1.0, 0)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [3, 1, 4, 1, 5, 9, 2]]


@pytest.fixture(scope="module")
def pair(llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    return {
        "near": build_near_draft(llama_path, root / "near", noise=0.05),
        "other": build_checkpoint(root / "other", seed=9),
        "same": llama_path,
    }


def shards(draft_path: str, target_path: str, acceptance: str = "tokens") -> RoundParts:
    draft = DraftShard(
        load_model(draft_path, torch.float32, CPU), CPU, 4, 96, acceptance, max_step_len=2
    )
    target = TargetShard(
        load_model(target_path, torch.float32, CPU), CPU, 4, 96, acceptance, max_step_len=9
    )
    return RoundParts(draft, target, None, 0, 0, 0, CPU, acceptance, overlap=True)


def target_alone(target_path: str, prompt: list[int], n: int, params=GREEDY) -> list[int]:
    """The target alone: one token per decode step (sampled: with the uniforms of its
    position, rng.STREAM_TARGET, as a round's corrections and bonus tokens use them)."""
    target = TargetShard(
        load_model(target_path, torch.float32, CPU), CPU, 1, 96, "tokens", max_step_len=2
    )
    target.prefill([0], [prompt], [params])
    tokens = target.decode([0], n)[0].tolist()
    return tokens


def run(
    parts: RoundParts, ks: list[int], join_at: int = 2, params=GREEDY
) -> tuple[dict, list[list[bool]]]:
    """Rounds of speculate_overlapped with draft lengths ks (the next round's announced as
    next_k); the third prompt joins before round `join_at`. Returns slot -> committed
    tokens, and each round's overlapped flags (its window drafted during the last verify)."""
    out: dict[int, list[int]] = {}
    for shard in (parts.draft, parts.target):
        shard.prefill([0, 2], PROMPTS[:2], [params, params])
    slots, kept_log = [0, 2], []
    for r, k in enumerate(ks):
        if r == join_at:
            for shard in (parts.draft, parts.target):
                shard.prefill([3], PROMPTS[2:], [params])
            slots = [0, 2, 3]
        next_k = ks[r + 1] if r + 1 < len(ks) else 0
        result = speculate_overlapped(parts, slots, k, next_k)
        kept_log.append(result.overlapped)
        for slot, tokens in zip(slots, result.tokens):
            out.setdefault(slot, []).extend(tokens)
    return out, kept_log


@pytest.mark.parametrize("draft", ["near", "other", "same"])
def test_greedy_equals_target_whatever_the_draft(pair, draft):
    ks = [4, 4, 3, 1, 4, 2, 4, 4]
    out, kept = run(shards(pair[draft], pair["same"]), ks)
    for slot, prompt in zip([0, 2, 3], PROMPTS):
        assert out[slot] == target_alone(pair["same"], prompt, len(out[slot])), slot
    flat = [flag for flags in kept for flag in flags]
    if draft == "same":  # every window kept: each round after a slot's first has one
        assert kept[:3] == [[False, False], [True, True], [True, True, False]]
        assert all(flat[7:])
    if draft == "other":  # a draft that is never right keeps nothing
        assert not any(flat)
    if draft == "near":  # rows of one round kept and rejected side by side
        assert any(any(f) and not all(f) for f in kept), kept


@pytest.mark.parametrize("draft", ["near", "other", "same"])
def test_sampled_tokens_acceptance_equals_the_targets_own_samples(pair, draft):
    """Under `acceptance: tokens` a sampled round keeps the target's bonus token (its own
    sample) like a greedy one, and every committed token is the target's own sample with the
    uniforms of its position: the output equals the target alone sampling, token for token,
    whatever the draft and whichever windows were kept."""
    ks = [4, 4, 3, 1, 4, 2, 4, 4]
    out, kept = run(shards(pair[draft], pair["same"]), ks, params=SAMPLED)
    for slot, prompt in zip([0, 2, 3], PROMPTS):
        assert out[slot] == target_alone(pair["same"], prompt, len(out[slot]), SAMPLED), slot
    flat = [flag for flags in kept for flag in flags]
    if draft == "same":  # coupled uniforms: the draft samples what the target does
        assert all(flat[7:]), kept


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_windows_survive_a_prefill_and_go_with_a_release(pair, params):
    """Greedy rounds take the target's bonus token (nothing held); sampled ones hold the
    target's last logits for the next window's first token (draft = target under `logits`
    acceptance keeps every window)."""
    parts = shards(pair["same"], pair["same"], "logits")
    held = {0, 2} if params is SAMPLED else set()
    for shard in (parts.draft, parts.target):
        shard.prefill([0, 2], PROMPTS[:2], [params, params])
    tokens = speculate_overlapped(parts, [0, 2], 3, 3).tokens
    assert set(parts.draft.windows) == {0, 2} and set(parts.target.held) == held
    assert [len(t) for t in tokens] == [3 if held else 4] * 2
    for shard in (parts.draft, parts.target):
        shard.prefill([3], PROMPTS[2:], [params])
    assert set(parts.draft.windows) == {0, 2}
    for shard in (parts.draft, parts.target):
        shard.release([2])
    assert set(parts.draft.windows) == {0} and set(parts.target.held) == held - {2}
    parts.draft.drop_windows()  # a target-only round: back to a pending token
    state = parts.draft.slots[0]
    assert not parts.draft.windows and state.cache_len + len(state.pending) == state.committed


def test_profiled_round_reports_cpu_time_beside_wall_time(pair):
    """TANDEM_PROFILE's phases carry the thread's CPU time too (`<phase>_cpu_s`): wall time
    well above it in a compute phase is time spent waiting for a core."""
    parts = shards(pair["near"], pair["same"])
    parts.profile = True
    for s in (parts.draft, parts.target):
        s.prefill([0], [PROMPTS[0]], [GREEDY])
    timing = speculate_overlapped(parts, [0], 3, 3).timing
    for phase in ("draft_s", "verify_or_next_window_s", "verdict_transfer_s"):
        cpu = timing[phase.removesuffix("_s") + "_cpu_s"]
        assert 0 <= cpu <= timing[phase] + 0.01


def test_cpu_workers_get_disjoint_core_blocks_only_when_asked(monkeypatch):
    """Each CPU worker's thread count is its share of the allowed cores; TANDEM_CPU_AFFINITY=1
    also pins it to its own block (checked in a thread: affinity is per thread on Linux)."""
    import os
    import threading

    from runtime.worker.process import _bind_cpu_block

    allowed = sorted(os.sched_getaffinity(0))
    seen: dict[str, object] = {}

    def bind(position: int, workers: int) -> None:
        seen["threads"] = _bind_cpu_block(position, workers)
        seen["cores"] = sorted(os.sched_getaffinity(0))

    def in_thread(position: int, workers: int) -> dict:
        t = threading.Thread(target=bind, args=(position, workers))
        t.start()
        t.join()
        return dict(seen)

    monkeypatch.delenv("TANDEM_CPU_AFFINITY", raising=False)
    assert in_thread(0, 1) == {"threads": len(allowed), "cores": allowed}
    monkeypatch.setenv("TANDEM_CPU_AFFINITY", "1")
    last = in_thread(len(allowed) - 1, len(allowed))
    assert last == {"threads": 1, "cores": [allowed[-1]]}
    assert in_thread(len(allowed), len(allowed)) == {"threads": 1, "cores": allowed}  # past
    assert in_thread(0, len(allowed) + 1)["threads"] == 1  # crowded
    assert sorted(os.sched_getaffinity(0)) == allowed  # this thread was never touched
