"""Programmatic dependent launch (runtime/models/kernels/pdl.py): when it is on, and what a
kernel launch gets. (The PDL path itself needs a Hopper GPU: examples/gpu/graphs_check.py and
fp8_check.py run the kernels with it, exact against eager; the interpreter has no PDL.)"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from runtime.models import kernels  # noqa: E402
from runtime.models.kernels import pdl  # noqa: E402


def test_never_on_the_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("TANDEM_PDL", raising=False)
    assert not pdl.supported(torch.device("cpu"))
    try:
        assert kernels.enable(torch.device("cpu"))
        assert kernels.enabled() and not kernels.pdl_on()
    finally:
        kernels.disable()


def test_by_capability_and_switch(monkeypatch):
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability["value"])
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("TANDEM_PDL", raising=False)
    assert pdl.supported(cuda)
    capability["value"] = (8, 9)                     # Ada: no griddepcontrol
    assert not pdl.supported(cuda)
    capability["value"] = (10, 0)
    monkeypatch.setenv("TANDEM_PDL", "0")
    assert not pdl.supported(cuda)


def test_launch_options():
    assert pdl.launch_options(False) == {"PDL": False}
    assert pdl.launch_options(True) == {"PDL": True, "launch_pdl": True}
    kernels.disable()
    assert not kernels.pdl_on()
