"""Programmatic dependent launch of the compiled pieces (runtime.models.arch.fused.pdl_supported):
when it is on, and that compile_kernels' switch respects inductor's own variable. (PDL itself
needs a Hopper GPU: lab/gpu/step_ab.py measures it and checks the logits bit for bit.)"""

from __future__ import annotations

import pytest
import torch

from runtime.models.arch import fused

inductor_config = pytest.importorskip("torch._inductor.config")
CUDA = torch.device("cuda", 0)


@pytest.fixture
def capability(monkeypatch):
    value = {"cc": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: value["cc"])
    monkeypatch.delenv("TORCHINDUCTOR_ENABLE_PDL", raising=False)
    saved = getattr(inductor_config.triton, "enable_pdl", None)
    yield value
    if saved is not None:
        inductor_config.triton.enable_pdl = saved


def test_by_device_capability(capability):
    assert fused.pdl_supported(CUDA)  # Hopper
    capability["cc"] = (10, 0)
    assert fused.pdl_supported(CUDA)  # Blackwell
    capability["cc"] = (8, 9)  # Ada: no griddepcontrol
    assert not fused.pdl_supported(CUDA)
    assert not fused.pdl_supported(torch.device("cpu"))


def test_inductor_switch_follows_unless_its_variable_is_set(capability, monkeypatch):
    if not hasattr(inductor_config.triton, "enable_pdl"):
        pytest.skip("this torch's inductor has no PDL switch")
    fused._inductor_pdl(CUDA)
    assert inductor_config.triton.enable_pdl is True
    capability["cc"] = (8, 0)
    fused._inductor_pdl(CUDA)
    assert inductor_config.triton.enable_pdl is False
    capability["cc"] = (9, 0)
    monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", "0")  # the user's word stands
    fused._inductor_pdl(CUDA)
    assert inductor_config.triton.enable_pdl is False
