"""Greedy speculative decoding end to end, through every launch form: the output equals the
target's own transformers greedy output token for token (float32, CPU).

Cases and launch forms are paired, not crossed: each case runs under two forms and each form
under three cases (how a process is launched and what a round computes are independent)."""

from __future__ import annotations

import pytest

from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(400)

PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [1, 40], [1, 77, 3, 8, 60, 61, 62, 63, 64, 65, 2, 33]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = checkpoints.build_checkpoint(root / "target", "llama", seed=0)
    qwen = checkpoints.build_checkpoint(root / "qwen", "qwen2", seed=2)
    return {
        "target": target,
        "other": checkpoints.build_checkpoint(root / "other", "llama", seed=1),
        "near": checkpoints.build_near_draft(target, root / "near", noise=0.05),
        "qwen": qwen,
        "qwen_near": checkpoints.build_near_draft(qwen, root / "qwen_near", noise=0.05),
    }


@pytest.fixture(scope="module")
def reference(models):
    return checkpoints.GreedyReference(models, PROMPTS, NEW_TOKENS)


# name: (draft, target, draft_len, draft devices, target devices, launch forms). Every form
# runs two cases, at least one of them overlapped (the other launch-form matrix is
# tests/e2e/test_spec_tp.py's).
CASES = {
    "disagreeing-draft": ("other", "target", 4, ["cpu:0"], ["cpu:1"], ("mpirun",)),
    "draft-is-target": ("target", "target", 4, ["cpu:0"], ["cpu:0"], ("torchrun",)),
    "k1": ("near", "target", 1, ["cpu:0"], ["cpu:1"], ("spawn",)),
    "k3": ("near", "target", 3, ["cpu:0"], ["cpu:1"], ("mpi-spawn",)),
    "k8": ("near", "target", 8, ["cpu:1"], ["cpu:0"], ("spawn",)),
    "qwen2": ("qwen_near", "qwen", 4, ["cpu:0"], ["cpu:1"], ("torchrun",)),
    # disjoint devices overlap by default (speculation.overlap auto): these two pin it
    "draft-is-target-apart": ("target", "target", 4, ["cpu:0"], ["cpu:1"], ("mpi-spawn",)),
    "k4-no-overlap": ("near", "target", 4, ["cpu:0"], ["cpu:1"], ("mpirun",)),
}
NO_OVERLAP = {"k4-no-overlap"}
PAIRS = [(case, form) for case, spec in CASES.items() for form in spec[-1]]


def test_pairs_cover_every_launch_form_evenly():
    assert sorted(form for _, form in PAIRS) == sorted(launch.FORMS * 2)


@pytest.mark.parametrize("case,form", PAIRS)
def test_greedy_equals_target(case, form, models, reference, tmp_path):
    draft, target, k, draft_devices, target_devices, _ = CASES[case]
    cfg = launch.write_config(
        tmp_path / "c.yaml",
        models[draft],
        models[target],
        draft_devices,
        target_devices,
        draft_len=k,
    )
    if case in NO_OVERLAP:
        launch.set_speculation(cfg, overlap=False)
    outs = launch.run_json(
        form, launch.world_size(draft_devices, target_devices), run_args(cfg, NEW_TOKENS)
    )
    assert [o["token_ids"] for o in outs] == reference(target)
    for out in outs:
        stats = out["stats"]
        assert set(stats) >= {"acceptance_rate", "mean_accepted_tokens", "rounds", "tokens_per_s"}
        assert out["finish_reason"] in ("length", "stop")
        # the first token comes before the last: tokens_per_s counts them all
        assert 0 < stats["time_to_first_token_s"] < len(out["token_ids"]) / stats["tokens_per_s"]
        # every round tests draft token 1, and token i+1 only when it kept token i
        positions = stats["accepted_per_position"]
        assert stats["tested_draft_tokens"] == stats["rounds"] + sum(positions[: k - 1])
        if case.startswith("draft-is-target"):
            assert stats["acceptance_rate"] > 0.9
        overlapped = not (set(draft_devices) & set(target_devices)) and case not in NO_OVERLAP
        if not overlapped:
            assert stats["overlapped_rounds"] == 0
        elif case == "draft-is-target-apart":  # every window kept but the last one's
            assert stats["overlapped_rounds"] >= stats["rounds"] - 1
    rates = [o["stats"]["acceptance_rate"] for o in outs]
    if case == "disagreeing-draft":
        assert max(rates) < 0.35
    if case in ("k3", "k8"):
        assert 0.0 < sum(rates) / len(rates) < 1.0


def run_args(cfg: str, new_tokens: int) -> list[str]:
    """`tandem run` of every prompt in PROMPTS."""
    args = ["run", cfg, "--max-new-tokens", str(new_tokens)]
    for prompt in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    return args


def run_auto(models, draft: str, new_tokens: int, tmp_path) -> list[dict]:
    """`draft_len: auto`, draft on cpu:0 and the target on cpu:1, spawn launch."""
    cfg = launch.write_config(
        tmp_path / "c.yaml", models[draft], models["target"], ["cpu:0"], ["cpu:1"], draft_len="auto"
    )
    return launch.run_json("spawn", 3, run_args(cfg, new_tokens))


def test_auto_draft_len_equals_target(models, reference, tmp_path):
    outs = run_auto(models, "near", NEW_TOKENS, tmp_path)
    assert [o["token_ids"] for o in outs] == reference("target")


def test_auto_with_a_disagreeing_draft_runs_target_only_rounds(models, tmp_path):
    """draft_len auto with a draft that is almost never right: the controller turns to
    target-only rounds (k = 0, several target steps per command), probes k = 1 now and then,
    and the output is still the target's greedy output."""
    new_tokens = 96
    outs = run_auto(models, "other", new_tokens, tmp_path)
    reference = checkpoints.GreedyReference(models, PROMPTS, new_tokens)
    assert [o["token_ids"] for o in outs] == reference("target")
    assert all(o["stats"]["target_only_rounds"] > 0 for o in outs), [o["stats"] for o in outs]
    assert all(o["stats"]["target_only_rounds"] < o["stats"]["rounds"] for o in outs)
