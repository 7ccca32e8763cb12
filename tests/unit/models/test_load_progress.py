"""Startup progress callbacks of the model room: load_model per tensor read (or drawn, for a
synthetic recipe), build_pair per tensor written, capture_all per CUDA graph (none on CPU)."""

from __future__ import annotations

import pytest
import torch

from runtime.models import load_model
from runtime.models.loading.synthetic import build_pair, tensor_plan
from runtime.models.runners.step_runner import StepRunner

pytestmark = pytest.mark.timeout(120)


def recorder() -> tuple[list[tuple[int, int]], object]:
    calls: list[tuple[int, int]] = []
    return calls, lambda done, total: calls.append((done, total))


def assert_counts_up(calls: list[tuple[int, int]], total: int) -> None:
    assert total > 0
    assert calls == [(done, total) for done in range(total + 1)]


def test_load_model_reports_every_tensor(llama_path):
    calls, progress = recorder()
    model = load_model(llama_path, torch.float32, "cpu", progress=progress)
    # every parameter is read once (tied weights would be read once for both names)
    assert_counts_up(
        calls,
        len(dict(model.named_parameters(remove_duplicate=False))) - model.args.tie_word_embeddings,
    )


def test_synthetic_recipe_reports_every_tensor_drawn(tmp_path):
    _, target = build_pair(tmp_path, "tiny", draft_layers=2, materialize=False)
    calls, progress = recorder()
    load_model(target, torch.float32, "cpu", progress=progress)
    assert_counts_up(calls, len(tensor_plan("tiny", "target", 2, 0.0)))


def test_build_pair_reports_every_tensor_written(tmp_path):
    calls, progress = recorder()
    build_pair(tmp_path, "tiny", draft_layers=1, progress=progress)
    assert_counts_up(
        calls,
        len(tensor_plan("tiny", "draft", 1, 0.0)) + len(tensor_plan("tiny", "target", 1, 0.0)),
    )
    calls.clear()
    build_pair(tmp_path / "recipe", "tiny", materialize=False, progress=progress)
    assert calls == []  # nothing drawn: loading draws it


def test_capture_all_reports_every_graph(llama_path, monkeypatch):
    """On CPU nothing is captured (and nothing reported); with capture on (here recorded
    instead of captured) every graph to capture counts, shapes captured before do not."""
    model = load_model(llama_path, torch.float32, "cpu")
    model.allocate_cache(4, 300)
    runner = StepRunner(model, torch.device("cpu"), max_batch=4, max_step_len=5)
    calls, progress = recorder()
    assert runner.capture_all([1, 5], progress=progress) == 0 and calls == []
    runner.capture = True
    monkeypatch.setattr(runner, "_capture", lambda key: runner.graphs.setdefault(key, key))
    runner.capture_all([1], progress=progress)
    first = len(runner.graphs)
    assert_counts_up(calls, first)
    calls.clear()
    assert runner.capture_all([1, 5], progress=progress) == 2 * first
    assert_counts_up(calls, first)  # only the shapes of length 5 are new


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_capture_all_reports_real_captures_on_cuda(llama_path):
    device = torch.device("cuda", 0)
    model = load_model(llama_path, torch.bfloat16, device)
    model.allocate_cache(2, 300)
    runner = StepRunner(model, device, max_batch=2, max_step_len=2)
    calls, progress = recorder()
    count = runner.capture_all([1, 2], progress=progress)
    assert count == len(runner.graphs) > 0
    assert_counts_up(calls, count)
