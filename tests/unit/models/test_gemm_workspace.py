"""runtime.models.loading.loader.no_gemm_workspace: CUDA processes run their GEMMs without a cuBLAS
/
cuBLASLt workspace (no split-K reduction kernels after the decode GEMMs), unless the user set
torch's variables; CPU processes are left alone. (Its speed is measured on an H200 by
lab/gpu/step_ab.py; docs/benchmarks.md.)"""

import os

import pytest
import torch

from runtime.models import load_model
from runtime.models.loading import loader
from tests.checkpoints import build_checkpoint

VARS = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_cuda_gets_no_workspace_and_cpu_is_left_alone(clean_env):
    loader.no_gemm_workspace(torch.device("cpu"))
    assert not any(var in os.environ for var in VARS)
    loader.no_gemm_workspace(torch.device("cuda", 0))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":0:0"
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "0"


def test_the_users_settings_stay(clean_env):
    clean_env.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    clean_env.setenv("CUBLASLT_WORKSPACE_SIZE", "1024")
    loader.no_gemm_workspace(torch.device("cuda", 1))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "1024"


def test_load_model_asks_for_its_device(clean_env, tmp_path):
    seen = []
    clean_env.setattr(loader, "no_gemm_workspace", seen.append)
    load_model(build_checkpoint(tmp_path / "m"), torch.float32, "cpu")
    assert seen == [torch.device("cpu")]
