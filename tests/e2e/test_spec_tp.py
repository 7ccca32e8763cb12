"""Tensor-parallel draft and target groups on their own (or shared) CPU devices: every layout
gives the target's transformers greedy output token for token, whatever launched it, and a
two-node torchrun launch (simulated on localhost) too."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from launcher.discovery import free_port
from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(400)

PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [1, 40], [1, 77, 3, 8, 60, 61, 62, 63, 64, 65, 2, 33]]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    a = checkpoints.build_checkpoint(root / "a", "llama", seed=0)  # 4 heads, 2 KV heads
    b = checkpoints.build_checkpoint(
        root / "b", "qwen2", seed=3, hidden_size=96, num_attention_heads=6, num_key_value_heads=1
    )
    return {
        "a": a,
        "a_near": checkpoints.build_near_draft(a, root / "a_near", noise=0.05),
        "a_other": checkpoints.build_checkpoint(root / "a_other", "llama", seed=1),
        "b": b,
        "b_near": checkpoints.build_near_draft(b, root / "b_near", noise=0.05),
    }


@pytest.fixture(scope="module")
def reference(models):
    return checkpoints.GreedyReference(models, PROMPTS, NEW_TOKENS)


# name: (draft, target, draft devices, target devices)
LAYOUTS = {
    "draft1-target2": ("b_near", "b", ["cpu:0"], ["cpu:1", "cpu:2"]),
    "draft2-target3-overlap": ("b_near", "b", ["cpu:0", "cpu:1"], ["cpu:1", "cpu:2", "cpu:3"]),
    "draft3-target1": ("b_near", "b", ["cpu:0", "cpu:1", "cpu:2"], ["cpu:3"]),
    "colocated-draft1-target2": ("a_near", "a", ["cpu:0"], ["cpu:0", "cpu:1"]),
    "both-tp2": ("a_near", "a", ["cpu:0", "cpu:1"], ["cpu:0", "cpu:1"]),
}
FORMS = {
    "draft1-target2": ("torchrun", "mpirun"),
    "draft2-target3-overlap": ("spawn",),
    "colocated-draft1-target2": ("spawn", "mpirun"),
    "both-tp2": ("spawn",),
    "draft3-target1": ("mpi-spawn",),
}


def args_for(cfg: str) -> list[str]:
    args = ["run", cfg, "--max-new-tokens", str(NEW_TOKENS)]
    for prompt in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    return args


@pytest.mark.parametrize("layout,form", [(lay, f) for lay, forms in FORMS.items() for f in forms])
def test_layout_equals_target(layout, form, models, reference, tmp_path):
    draft, target, draft_devices, target_devices = LAYOUTS[layout]
    cfg = launch.write_config(
        tmp_path / "c.yaml",
        models[draft],
        models[target],
        draft_devices,
        target_devices,
        draft_len=3,
    )
    outs = launch.run_json(
        form, launch.world_size(draft_devices, target_devices), args_for(cfg), timeout=300
    )
    assert [o["token_ids"] for o in outs] == reference(target)
    assert all(o["stats"]["acceptance_rate"] > 0 for o in outs)


def test_auto_target_only_rounds_under_tp(models, tmp_path):
    """draft_len auto with a draft that is almost never right, the target TP 2 sharing its
    first device with the draft: target-only rounds (each decoding the next one's first
    step ahead on both target ranks, dropped when a probe round drafts) keep the target's
    greedy output."""
    new_tokens = 64
    cfg = launch.write_config(
        tmp_path / "c.yaml",
        models["a_other"],
        models["a"],
        ["cpu:0"],
        ["cpu:0", "cpu:1"],
        draft_len="auto",
    )
    outs = launch.run_json(
        "spawn",
        3,
        [
            "run",
            cfg,
            "--max-new-tokens",
            str(new_tokens),
            *sum((["--prompt-ids", ",".join(map(str, p))] for p in PROMPTS), []),
        ],
        timeout=300,
    )
    reference = checkpoints.GreedyReference(models, PROMPTS, new_tokens)
    assert [o["token_ids"] for o in outs] == reference("a")
    counts = [(o["stats"]["target_only_rounds"], o["stats"]["rounds"]) for o in outs]
    assert all(0 < only < rounds for only, rounds in counts), counts


@pytest.mark.parametrize(
    "draft_devices, target_devices",
    [
        (["cpu:0"], ["cpu:1", "cpu:2"]),  # global numbering
        (["cpu:0"], ["n1:cpu:0", "n1:cpu:1"]),  # each node's own (docs/multinode.md)
    ],
    ids=["global", "per-node"],
)
def test_two_nodes_simulated(models, reference, tmp_path, draft_devices, target_devices):
    """Two torchrun agents (node ranks 0 and 1) on localhost, 2 processes each: the
    orchestrator and the draft on node 0, the TP-2 target on node 1."""
    cfg = launch.write_config(
        tmp_path / "c.yaml",
        models["a_near"],
        models["a"],
        draft_devices,
        target_devices,
        draft_len=3,
    )
    port = str(free_port())
    procs = []
    for node in (0, 1):
        cmd = [
            str(launch.BIN / "torchrun"),
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "-m",
            "launcher",
            *args_for(cfg),
            "--json",
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
                env=launch.clean_env(),
            )
        )
    results = []
    try:
        for proc in procs:
            results.append(proc.communicate(timeout=300))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for proc in procs:
        launch.assert_group_gone(proc.pid)
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    outs = [json.loads(line) for line in results[0][0].splitlines() if line.startswith("{")]
    assert [o["token_ids"] for o in outs] == reference("a")
