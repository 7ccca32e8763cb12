"""FP8 models through the whole system (float32, CPU: the weight-only GEMM).

Greedy speculation with an FP8 target equals that target's own greedy output, i.e. a float32
transformers model holding the dequantized weights: a stored FP8 checkpoint on its own
device, and a float checkpoint quantized on load as a TP 2 target whose rank 0 shares its
device with an FP8 draft. Sampling with FP8 draft and target follows the FP8 target's
distribution (the chi-square check of test_spec_sampling). And `tandem bench
--quantization fp8`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import yaml

from runtime import Engine
from tests import checkpoints, fp8_checkpoints, launch
from tests.e2e import test_spec_sampling as sampling
from tests.e2e.test_spec_greedy import PROMPTS, run_args

pytestmark = pytest.mark.timeout(300)

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_models")
    target = checkpoints.build_checkpoint(root / "target", "llama", seed=0)
    fp8_target, fp8_reference = fp8_checkpoints.write_fp8(target, root / "ct", "ct-channel-static")
    return {
        "target": target,
        "near": checkpoints.build_near_draft(target, root / "near", 0.05),
        "fp8_target": fp8_target,
        "fp8_reference": fp8_reference,
        "quantized_reference": fp8_checkpoints.write_quantized_reference(
            target, root / "quantized"
        ),
    }


def write_config(
    path,
    draft: str,
    target: str,
    draft_devices,
    target_devices,
    draft_quantization=None,
    target_quantization=None,
) -> str:
    cfg = launch.write_config(path, draft, target, draft_devices, target_devices, draft_len=3)
    data = yaml.safe_load(open(cfg))
    data["draft"]["quantization"] = draft_quantization
    data["target"]["quantization"] = target_quantization
    path.write_text(yaml.safe_dump(data))
    return cfg


def reference(model_dir: str) -> list[list[int]]:
    return [checkpoints.hf_greedy(model_dir, p, NEW_TOKENS) for p in PROMPTS]


def test_stored_fp8_target_equals_its_own_greedy(models, tmp_path):
    """compressed-tensors FP8 target (per-channel weights, static input scales) on cpu:1,
    float draft on cpu:0."""
    cfg = write_config(
        tmp_path / "c.yaml", models["near"], models["fp8_target"], ["cpu:0"], ["cpu:1"]
    )
    outs = launch.run_json("spawn", 3, run_args(cfg, NEW_TOKENS))
    assert [o["token_ids"] for o in outs] == reference(models["fp8_reference"])
    assert sum(o["stats"]["acceptance_rate"] for o in outs) > 0  # the draft is used


def test_quantized_tp2_target_colocated_with_fp8_draft(models, tmp_path):
    """quantization: fp8 on float checkpoints: the target TP 2 on cpu:0, cpu:1 (its scales
    sharded with its weights), the draft quantized too and sharing cpu:0."""
    cfg = write_config(
        tmp_path / "c.yaml",
        models["near"],
        models["target"],
        ["cpu:0"],
        ["cpu:0", "cpu:1"],
        "fp8",
        "fp8",
    )
    outs = launch.run_json("spawn", 3, run_args(cfg, NEW_TOKENS))
    assert [o["token_ids"] for o in outs] == reference(models["quantized_reference"])


def test_sampling_follows_the_fp8_target(tmp_path_factory, tmp_path):
    """Logits acceptance, FP8 draft (quantized on load) and FP8 target (fbgemm, per-channel,
    dynamic activations): the samples follow the dequantized target, not the draft."""
    root = tmp_path_factory.mktemp("fp8_vocab24")
    kw = dict(
        vocab_size=sampling.VOCAB,
        initializer_range=0.08,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    target = checkpoints.build_checkpoint(root / "target", "llama", seed=10, **kw)
    draft = checkpoints.build_checkpoint(root / "draft", "llama", seed=11, **kw)
    fp8_target, target_ref = fp8_checkpoints.write_fp8(target, root / "fbgemm", "fbgemm")
    draft_ref = fp8_checkpoints.write_quantized_reference(draft, root / "draft_ref")
    cfg = write_config(tmp_path / "c.yaml", draft, fp8_target, ["cpu:0"], ["cpu:1"], "fp8")
    data = yaml.safe_load(open(cfg))
    data["speculation"]["acceptance"] = "logits"
    data["runtime"]["max_batch_size"] = 256
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    setting = sampling.SETTINGS[0]
    with Engine.launch(cfg) as engine:
        outs = engine.generate(
            prompt_token_ids=[sampling.PROMPT] * sampling.SAMPLES,
            max_new_tokens=2,
            seed=7,
            **setting,
        )
    counts = np.zeros((sampling.VOCAB, sampling.VOCAB))  # (first, second) token
    for out in outs:
        counts[out.token_ids[0], out.token_ids[1]] += 1
    target_p = sampling.exact_joint(target_ref, setting)
    assert sampling.chi_square_p(counts, target_p) > 1e-3
    assert sampling.chi_square_p(counts.sum(1), target_p.sum(1)) > 1e-3
    assert sampling.chi_square_p(counts, sampling.exact_joint(draft_ref, setting)) < 1e-6


def test_bench_quantization_fp8(tmp_path):
    """`tandem bench --quantization fp8`: target and spec in FP8 (the synthetic recipe
    quantized on load), the transformers row marked float; the roofline's bytes are the FP8
    weights, their float32 scales and the float32 head."""
    out = tmp_path / "bench.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "bench",
            "--synthetic",
            "tiny",
            "--device",
            "cpu",
            "--quantization",
            "fp8",
            "--modes",
            "target,spec,hf",
            "--prompt-len",
            "8",
            "--new-tokens",
            "8",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=launch.clean_env(),
    )
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["settings"]["quantization"] == "fp8"
    rows = {r["mode"]: r for r in report["results"]}
    assert rows["target"]["status"] == rows["spec"]["status"] == "ok"
    assert rows["spec"]["tokens_equal_target"] is True
    assert rows["hf"]["note"] == "float32 weights, not FP8" and "not FP8" in res.stdout
    # tiny: 4 layers of 36864 FP8 weights + 512 scales (4 bytes) + 2 norms of 64 (4 bytes),
    # the final norm and the untied 256 x 64 head in float32 (the input embedding not read)
    assert report["target_weight_bytes"] == 4 * (36864 + 4 * 512 + 4 * 128) + 4 * 64 + 4 * 256 * 64
