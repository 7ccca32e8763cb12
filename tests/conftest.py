"""The suite: tests/unit/ (no processes; a folder per room of runtime/) and tests/e2e/
(launches, faults, fuzzing, serving, HTTP). Checkpoint builders and launch helpers shared by
both live beside this file (checkpoints.py, launch.py, processes.py, model_helpers.py)."""

import os
from pathlib import Path

import pytest

E2E = Path(__file__).parent / "e2e"


def pytest_collection_modifyitems(items) -> None:
    """Every test under tests/e2e/ launches processes: marked `launch`, so that
    `pytest -m "not launch"` runs the fast set (README, "Tests")."""
    for item in items:
        if E2E in Path(item.fspath).parents:
            item.add_marker(pytest.mark.launch)


@pytest.fixture(scope="session", autouse=True)
def gguf_cache_dir(tmp_path_factory):
    """A test run's GGUF cache (runtime.models.loading.gguf_cache) is its own, never the user's:
    every process the tests start inherits TANDEM_CACHE_DIR."""
    path = tmp_path_factory.mktemp("tandem-cache")
    old = os.environ.get("TANDEM_CACHE_DIR")
    os.environ["TANDEM_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TANDEM_CACHE_DIR", None)
    else:
        os.environ["TANDEM_CACHE_DIR"] = old
