"""examples/quickstart.py runs as the README says, on the built-in demo model; CPU smoke runs
of examples/cpu/overlap_bench.py, examples/gpu/serving_kv.py and examples/gpu/serving_mixed.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_quickstart_runs():
    res = subprocess.run(
        [sys.executable, "examples/quickstart.py"],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=280,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("'The three primary colors are' -> ")
    assert "24 tokens, finish_reason=length, acceptance=1.00" in lines[1]
    assert sum(line.startswith("  sampled: ") for line in lines) == 2
    # the stream is the greedy generation again, delta by delta
    assert lines[-1].split(" (streamed) -> ")[1] == lines[0].split(" -> ", 1)[1].strip("'")


@pytest.mark.timeout(300)
def test_overlap_bench_runs(tmp_path):
    """examples/cpu/overlap_bench.py on a tiny synthetic pair: both modes, the same tokens'
    count, and overlap on counts overlapped rounds (draft = target here: eps 0)."""
    from runtime.models.loading.synthetic import build_pair

    build_pair(str(tmp_path), "tiny", 1, eps=0.0)
    res = subprocess.run(
        [
            sys.executable,
            "examples/cpu/overlap_bench.py",
            str(tmp_path),
            "--calls",
            "1",
            "--new-tokens",
            "12",
            "--prompt-len",
            "8",
        ],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=280,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    on, off, ratio = res.stdout.splitlines()[-3:]
    assert on.startswith("overlap on : ") and off.startswith("overlap off: ")
    assert float(on.split("overlapped ")[1]) > 0 and off.endswith("overlapped 0.0")
    assert "alpha 1.000" in on and "per call (same prompt) median" in ratio
    assert ratio.startswith("on / off: ")


def test_bench_scripts_name_scripts_that_exist():
    """examples/h200_bench.sh runs what examples/ holds (the lab's experiments are in
    lab/h200_lab.sh), and every script either names is there; both parse."""
    for script in ("examples/h200_bench.sh", "lab/h200_lab.sh"):
        text = (ROOT / script).read_text()
        for path in re.findall(r"\b(?:examples|lab)/[\w/]+\.(?:py|sh)", text):
            assert (ROOT / path).is_file(), f"{script} names {path}"
        assert subprocess.run(["bash", "-n", script], cwd=ROOT).returncode == 0
    bench = (ROOT / "examples" / "h200_bench.sh").read_text()
    assert not re.findall(r"python lab/", bench)


@pytest.mark.timeout(300)
def test_serving_kv_runs(tmp_path):
    """examples/gpu/serving_kv.py on the tiny pair on CPU: the cached prompt finds its
    prefix (32 tokens, two whole blocks), a fresh one nothing; the concurrent call generates
    every token without preemptions; the table has a row per measurement."""
    out = tmp_path / "kv.json"
    res = subprocess.run(
        [
            sys.executable,
            "examples/gpu/serving_kv.py",
            "ttft",
            "serve",
            "--synthetic",
            "tiny",
            "--device",
            "cpu",
            "--prompt-len",
            "32",
            "--suffix-len",
            "8",
            "--runs",
            "1",
            "--concurrency",
            "2",
            "--new-tokens",
            "4",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=280,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    ttft, serve = results["ttft"], results["serve-2-32"]
    assert ttft["cached_prompt_tokens"] == [32] == [ttft["expected_cached_tokens"]]
    assert ttft["uncached_prompt_tokens"] == [0] and ttft["ttft_cached_median_s"] > 0
    assert serve["generated_tokens"] == 8 and serve["num_preemptions"] == 0
    assert serve["kv_blocks_total"] > 0 and serve["tokens_per_s"] > 0
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == [
        "| ttft cached",
        "| ttft uncached",
        "| serve-2-32",
    ]


@pytest.mark.timeout(180)
def test_serving_mixed_runs(tmp_path):
    """examples/gpu/serving_mixed.py on the tiny pair on CPU (issue 36's benchmark, small):
    two steady streams outlast two long prompts, chunked 16 tokens a step; both windows have
    gaps, every long request finishes with its TTFT, and the table has both windows."""
    out = tmp_path / "mixed.json"
    res = subprocess.run(
        [
            sys.executable,
            "examples/gpu/serving_mixed.py",
            "--synthetic",
            "tiny",
            "--device",
            "cpu",
            "--streams",
            "2",
            "--stream-new-tokens",
            "4000",
            "--long-prompt-len",
            "64",
            "--long-count",
            "2",
            "--long-every",
            "0.2",
            "--max-prefill-tokens",
            "16",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=170,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"settings", "versions", "hardware", "date"} <= set(report)
    r = report["results"]
    assert r["max_prefill_tokens"] == 16 and r["streams"] == 2 and r["streams_outlasted"]
    for name in ("baseline", "mixed"):
        w = r[name]
        assert w["length_s"] > 0 and w["tokens"] > 0 and w["tokens_per_s"] > 0, name
        for gaps in (w["token_gap_s"], w["arrival_gap_s"]):
            assert 0 < gaps["p50"] <= gaps["p90"] <= gaps["p99"] <= gaps["max"], name
            assert gaps["p99_over_p50"] >= 1 and gaps["count"] > 0
        assert w["arrival_gap_s"]["max"] >= w["token_gap_s"]["max"]
    assert r["long_finished"] == 2 and len(r["long_requests"]) == 2
    for long in r["long_requests"]:
        assert long["finished"] and long["tokens"] == 16 and "error" not in long
        assert 0 < long["ttft_s"] <= long["total_s"]
    assert 0 < r["long_ttft_p50_s"] <= r["long_ttft_max_s"] <= r["long_total_max_s"]
    assert r["long_requests"][1]["submitted_s"] >= 0.2 - 0.05
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| baseline", "| long prompts"]
