"""`tandem bench`: the CPU run of the synthetic tiny pair writes every figure with sane types
(the speed numbers themselves are not checked), and the formulas behind the derived figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from runtime.bench import metrics
from tests import launch

pytestmark = pytest.mark.timeout(300)

FIGURES = (
    "tokens_per_s",
    "speedup_over_target",
    "acceptance_rate",
    "mean_accepted_tokens",
    "c",
    "theoretical_speedup",
    "efficiency",
    "roofline_fraction",
    "decode_roofline_fraction",
)
MODES = ("target", "spec", "hf", "hf-compiled", "hf-assisted")
K, NEW = 4, 8


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """The CPU smoke run: its JSON report and its printed table."""
    out = tmp_path_factory.mktemp("bench") / "tmp.json"
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
            "--batch-sizes",
            "1,2",
            "--prompt-len",
            "8",
            "--new-tokens",
            str(NEW),
            "--draft-len",
            str(K),
            "--modes",
            ",".join(MODES),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=launch.clean_env(),
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert "| spec | 1 |" in res.stdout, res.stdout
    return json.loads(out.read_text()), res.stdout


@pytest.fixture(scope="module")
def report(bench_run):
    return bench_run[0]


def rows(report, mode):
    return {r["batch_size"]: r for r in report["results"] if r["mode"] == mode}


def is_num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def test_header(report):
    s = report["settings"]
    assert s["synthetic"] == "tiny" and s["batch_sizes"] == [1, 2]
    assert (s["prompt_len"], s["new_tokens"], s["draft_len"]) == (8, NEW, K)
    assert s["modes"] == list(MODES) and s["dtype"] == "float32" and s["device"] == "cpu"
    assert isinstance(report["date"], str) and report["date"][:2] == "20"
    assert report["hardware"]["device_type"] == "cpu" and report["hardware"]["device"]
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["transformers"]
    assert report["copy_bandwidth_bytes_per_s"] > 0 and report["target_weight_bytes"] > 0


def test_every_row_has_every_figure(report):
    assert {(r["mode"], r["batch_size"]) for r in report["results"]} == {
        (m, b) for m in MODES for b in (1, 2)
    }
    for r in report["results"]:
        for name in FIGURES:
            assert name in r, (r["mode"], name)
            assert r[name] is None or is_num(r[name]), (r["mode"], name, r[name])
        if r["status"] == "ok":
            assert is_num(r["tokens_per_s"]) and r["tokens_per_s"] > 0
            assert r["generated_tokens"] == r["batch_size"] * NEW
        else:
            assert r["status"] == "skipped" and r["reason"], r


def test_target(report):
    for r in rows(report, "target").values():
        assert r["status"] == "ok"
        assert 0 < r["roofline_fraction"] < 10  # CPU timing noise aside, a fraction
        assert_decode_roofline(report, r)
        assert r["acceptance_rate"] is None and r["c"] is None
        assert_first_token_times(r)


def assert_decode_roofline(report, r):
    """The decode steps alone (the first token left out), the weights and each row's KV at
    the mean context read a step."""
    steps = r["generated_tokens"] // r["batch_size"] - 1
    seconds = (r["wall_s"] - r["time_to_first_token_s"][0]) / steps
    context = 8 + NEW / 2  # --prompt-len 8
    step_bytes = (
        report["target_weight_bytes"]
        + report["target_kv_position_bytes"] * context * r["batch_size"]
    )
    assert report["target_kv_position_bytes"] > 0
    assert r["decode_roofline_fraction"] == pytest.approx(
        step_bytes / report["copy_bandwidth_bytes_per_s"] / seconds
    )


def assert_first_token_times(r):
    """One time to first token per prompt, within the call's wall time."""
    times = r["time_to_first_token_s"]
    assert len(times) == r["batch_size"] and all(0 < t < r["wall_s"] for t in times), r


def test_spec(report):
    for r in rows(report, "spec").values():
        assert r["status"] == "ok", r
        assert 0 <= r["acceptance_rate"] <= 1 and 0 <= r["alpha"] <= 1
        assert 1 <= r["mean_accepted_tokens"] <= K + 1
        assert r["c"] > 0 and 0 < r["theoretical_speedup"] <= K + 1
        assert r["efficiency"] > 0 and r["roofline_fraction"] is None
        assert r["theoretical_speedup"] == pytest.approx(
            metrics.theoretical_speedup(r["alpha"], K, r["c"])
        )
        assert r["tokens_equal_target"] is True  # greedy float32: the target's own tokens
        assert r["decode_efficiency"] > 0  # without the first token of either mode
        assert_first_token_times(r)


def test_speedup_over_target(bench_run):
    """Every row but `target`'s carries its tokens/s over the target's at the same batch
    size, in the JSON and in the printed table's speed-up column."""
    report, stdout = bench_run
    header = next(line for line in stdout.splitlines() if line.startswith("| mode |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[:4] == ["mode", "batch", "tokens/s", "speed-up"], header
    printed = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == len(columns) and cells[0] in MODES:
            printed[cells[0], int(cells[1])] = cells[3]
    for r in report["results"]:
        base = rows(report, "target")[r["batch_size"]]["tokens_per_s"]
        key = (r["mode"], r["batch_size"])
        if r["mode"] == "target" or r["status"] != "ok":
            assert r["speedup_over_target"] is None and printed[key] == "-", key
            continue
        assert r["speedup_over_target"] == pytest.approx(r["tokens_per_s"] / base), key
        assert printed[key] == f"{r['speedup_over_target']:.2f}x", key
    for r in rows(report, "spec").values():
        assert r["efficiency"] == pytest.approx(r["speedup_over_target"] / r["theoretical_speedup"])


def test_table_speedup_column():
    """report.table without a run: a spec row at 2.5x its target's tokens/s prints 2.50x;
    a row with no target beside it, and the target row itself, print -."""
    from runtime.bench import report as bench_report

    rows_ = [
        bench_report.row("target", 1, tokens_per_s=100.0),
        bench_report.row("spec", 1, tokens_per_s=250.0, speedup_over_target=2.5),
        bench_report.row("spec", 2, tokens_per_s=300.0),
    ]
    lines = bench_report.table(rows_).splitlines()
    assert lines[0].startswith("| mode | batch | tokens/s | speed-up |")
    assert lines[2].startswith("| target | 1 | 100.0 | - |")
    assert lines[3].startswith("| spec | 1 | 250.0 | 2.50x |")
    assert lines[4].startswith("| spec | 2 | 300.0 | - |")
    assert all("speedup_over_target" in r for r in rows_)


def test_transformers_modes(report):
    for r in rows(report, "hf").values():
        assert r["status"] == "ok" and r["acceptance_rate"] is None
    for r in rows(report, "hf-compiled").values():  # on CPU only with --compile-on-cpu
        assert r["status"] == "skipped" and "CPU" in r["reason"]
    assisted = rows(report, "hf-assisted")
    assert assisted[1]["status"] == "ok"
    assert 0 <= assisted[1]["acceptance_rate"] <= 1
    assert 1 <= assisted[1]["mean_accepted_tokens"] <= K + 1
    assert assisted[2]["status"] == "skipped" and "batch size 1" in assisted[2]["reason"]


def test_theoretical_speedup():
    assert metrics.theoretical_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert metrics.theoretical_speedup(1.0, 4, 0.1) == pytest.approx(5 / 1.4)
    assert metrics.theoretical_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)
    a = 0.8
    assert metrics.theoretical_speedup(a, 4, 0.05) == pytest.approx(
        (1 + a + a**2 + a**3 + a**4) / 1.2
    )
    assert metrics.theoretical_speedup(0.999999, 4, 0.0) == pytest.approx(5.0, rel=1e-4)
    with pytest.raises(ValueError):
        metrics.theoretical_speedup(1.5, 4, 0.1)


def test_alpha_estimates():
    for a in (0.0, 0.3, 0.8, 0.97):
        tokens = sum(a**i for i in range(5))
        assert metrics.alpha_from_tokens_per_round(tokens, 4) == pytest.approx(a, abs=1e-6)


def test_synthetic_shards_match_single_file(tmp_path):
    from runtime.models.loading.synthetic import build_pair
    from runtime.models.loading.weights import SafetensorsWeights

    _, single = build_pair(tmp_path / "a", "tiny", 2, eps=0.1)
    draft, sharded = build_pair(tmp_path / "b", "tiny", 2, eps=0.1, shard_bytes=50_000)
    assert (tmp_path / "b" / "target" / "model.safetensors.index.json").is_file()
    a, b = SafetensorsWeights(single), SafetensorsWeights(sharded)
    assert a.names() == b.names()
    assert all(torch.equal(a.get(n), b.get(n)) for n in a.names())
    d = SafetensorsWeights(draft)
    assert torch.equal(
        d.get("model.layers.1.mlp.down_proj.weight"), b.get("model.layers.1.mlp.down_proj.weight")
    )
    assert torch.equal(
        b.get("model.layers.2.mlp.down_proj.weight"), a.get("model.layers.2.mlp.down_proj.weight")
    )


def test_synthetic_recipe_draws_the_files_weights(tmp_path):
    """A recipe (no weight files) loads the very tensors build_pair writes, whole or as one
    tensor-parallel slice, and holds only config.json and synthetic.json."""
    from runtime.models.loading.loader import open_weights
    from runtime.models.loading.synthetic import build_pair
    from runtime.models.loading.weights import SafetensorsWeights

    draft, target = build_pair(tmp_path / "files", "tiny", 2, eps=0.1)
    recipe_draft, recipe_target = build_pair(
        tmp_path / "recipe", "tiny", 2, eps=0.1, materialize=False
    )
    assert sorted(p.name for p in (tmp_path / "recipe" / "target").iterdir()) == [
        "config.json",
        "synthetic.json",
    ]
    for files, recipe in ((draft, recipe_draft), (target, recipe_target)):
        a, b = SafetensorsWeights(files), open_weights(recipe)
        assert a.names() == b.names()
        assert all(torch.equal(a.get(n), b.get(n)) for n in a.names())
    b = open_weights(recipe_target)
    name = "model.layers.3.mlp.gate_proj.weight"
    assert torch.equal(b.get_shard(name, 0, 64, 128), b.get(name)[64:128])
    assert torch.equal(
        b.get("model.layers.3.self_attn.o_proj.weight"),
        SafetensorsWeights(target).get("model.layers.3.self_attn.o_proj.weight"),
    )


def test_tensor_parallel_target_phase(tmp_path):
    """--target-tp 2 (gloo on CPU): the target mode and the step costs come from two TP ranks
    in their own processes, and the spec engine's tokens equal that target's."""
    out = tmp_path / "tp.json"
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
            "--target-tp",
            "2",
            "--batch-sizes",
            "1,2",
            "--prompt-len",
            "8",
            "--new-tokens",
            str(NEW),
            "--draft-len",
            str(K),
            "--modes",
            "target,spec",
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
    assert "TP ranks" in res.stderr
    assert report["settings"]["target_tp"] == 2
    for bsz in (1, 2):
        assert rows(report, "target")[bsz]["status"] == "ok"
        spec = rows(report, "spec")[bsz]
        assert spec["tokens_equal_target"] is True
        assert is_num(spec["c"]) and is_num(spec["efficiency"])


def test_qwen3_synthetic_shape(tmp_path):
    """--synthetic qwen3-tiny (runtime.models.loading.synthetic_shapes): a Qwen3 recipe pair
    through the target and spec modes, the spec engine's tokens equal the target's (~12 s)."""
    out = tmp_path / "qwen3.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "bench",
            "--synthetic",
            "qwen3-tiny",
            "--device",
            "cpu",
            "--batch-sizes",
            "1",
            "--prompt-len",
            "8",
            "--new-tokens",
            str(NEW),
            "--draft-len",
            str(K),
            "--modes",
            "target,spec",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=launch.clean_env(),
    )
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["settings"]["synthetic"] == "qwen3-tiny"
    assert rows(report, "target")[1]["status"] == "ok"
    assert rows(report, "spec")[1]["tokens_equal_target"] is True


def test_config_and_synthetic_together_is_a_usage_error(tmp_path, capsys):
    from launcher.cli import main

    assert main(["bench", str(tmp_path / "c.yaml"), "--synthetic", "tiny"]) == 2
    assert "not both" in capsys.readouterr().err


def test_resolve_config_and_devices(tmp_path):
    from runtime.bench import runner
    from runtime.models.loading.synthetic import build_pair

    draft, target = build_pair(tmp_path, "tiny", 2)
    path = launch.write_config(tmp_path / "c.yaml", draft, target, draft_len=3)
    st = runner.resolve(
        runner.BenchSettings(
            config=path, synthetic=None, batch_sizes=[1, 9], prompt_len=300, new_tokens=40
        )
    )
    cfg = st.engine_config
    assert (st.draft, st.target, st.draft_len, st.target_tp) == (draft, target, 3, 1)
    assert str(st.draft_device) == "cpu" and st.target_dtype == torch.float32
    assert cfg["speculation"]["draft_len"] == 3 and cfg["runtime"]["max_batch_size"] == 9
    assert cfg["runtime"]["max_seq_len"] >= 300 + 40 + 3
    # CUDA devices go into the tandem config as integer ids
    assert runner._engine_device(runner._torch_device("cuda")) == 0
    assert runner._engine_device(torch.device("cuda", 1)) == 1
    assert runner._engine_device(torch.device("cpu")) == "cpu:0"


def test_theoretical_overlap_speedup():
    # the docs' table: c 0.3 at k 2, c 0.2 at k 4 (alpha 0.8)
    assert metrics.theoretical_overlap_speedup(0.8, 2, 0.3) == pytest.approx(
        1.6 / (1 + (1 - 0.8**3) * 0.6)
    )
    assert round(metrics.theoretical_overlap_speedup(0.8, 2, 0.3), 2) == 1.24
    assert round(metrics.theoretical_overlap_speedup(0.8, 4, 0.2), 2) == 1.17
    # every window kept: a round costs the longer of the two sides
    assert metrics.theoretical_overlap_speedup(1.0, 2, 0.3) == pytest.approx(1.6)
    assert metrics.theoretical_overlap_speedup(1.0, 4, 0.5) == pytest.approx(3.0 / 2.5)
    # none kept: the next window is drafted during the verify for nothing
    assert metrics.theoretical_overlap_speedup(0.0, 2, 0.3) == pytest.approx(1.0)
    assert metrics.theoretical_overlap_speedup(0.0, 2, 0.5) == pytest.approx(2.0 / 2.5)
    with pytest.raises(ValueError):
        metrics.theoretical_overlap_speedup(0.8, 0, 0.3)


class _Recorder:
    """A bench mode that records the order of its calls; call i takes walls[i] seconds."""

    def __init__(self, name, walls, calls):
        self.name, self.walls, self.calls = name, list(walls), calls

    def run(self, prompts, new_tokens):
        from runtime.bench.modes import Outcome

        self.calls.append(self.name)
        return Outcome(tokens=10, wall_s=self.walls.pop(0))


def test_side_by_side_calls_take_turns():
    from runtime.bench.modes import timed_side_by_side

    calls = []
    modes = {
        "a": _Recorder("a", [9, 1.0, 3.0, 2.0], calls),
        "b": _Recorder("b", [9, 4.0, 5.0, 6.0], calls),
    }
    outs = timed_side_by_side(modes, [[1]], 4, warmup=1, repeats=3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert outs["a"].wall_s == 2.0 and outs["b"].wall_s == 5.0  # the medians
    assert outs["a"].extra["call_tokens_per_s"] == [10.0, 10 / 3, 5.0]


def test_overlap_on_and_off_side_by_side(tmp_path):
    """A config with draft and target on their own CPU devices: `spec` (overlap on) and
    `spec-sequential` (off) run side by side, greedy tokens equal; the spec row carries the
    measured on/off ratio and the model's; only the overlapped engine kept windows (the
    draft equals the target: eps 0)."""
    from runtime.models.loading.synthetic import build_pair

    draft, target = build_pair(tmp_path, "tiny", 2)
    cfg = launch.write_config(tmp_path / "c.yaml", draft, target, draft_len=2)
    out = tmp_path / "ov.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "bench",
            cfg,
            "--prompt-len",
            "8",
            "--new-tokens",
            "24",
            "--repeats",
            "3",
            "--modes",
            "target,spec,spec-sequential",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=launch.clean_env(),
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert "spec, spec-sequential: batch 1" in res.stderr
    report = json.loads(out.read_text())
    on, off = rows(report, "spec")[1], rows(report, "spec-sequential")[1]
    assert on["status"] == off["status"] == "ok"
    assert on["tokens_equal_target"] is True and off["tokens_equal_target"] is True
    assert on["overlap_share"] > 0.5 and off["overlap_share"] == 0.0
    assert on["overlap_speedup"] == pytest.approx(on["tokens_per_s"] / off["tokens_per_s"])
    assert on["alpha"] == 1.0 and is_num(on["theoretical_overlap_speedup"])
    assert "overlap" in on["note"] and "overlap_speedup" not in off
    assert len(on["call_tokens_per_s"]) == len(off["call_tokens_per_s"]) == 3
