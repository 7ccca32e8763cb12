"""runtime.models.blas: the GEMMs' cuBLAS settings by TANDEM_BLAS. The CUDA branch is run
with torch's backend switch recorded (this CPU build has no cuBLASLt to switch to); the
reduction flags are torch's own and are set for real. (The speed of the settings is measured
on an H200 by examples/gpu/step_ab.py.)"""
import pytest
import torch

from runtime.models import blas

MATMUL = torch.backends.cuda.matmul


@pytest.fixture
def library(monkeypatch):
    """torch.backends.cuda.preferred_blas_library, recorded."""
    calls, current = [], ["cublas"]

    def preferred(backend=None):
        if backend is not None:
            calls.append(backend)
            current[0] = backend
        return current[0]
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    return calls


def test_choice_defaults_to_cublas_and_names_a_bad_value(monkeypatch):
    monkeypatch.delenv("TANDEM_BLAS", raising=False)
    assert blas.blas_choice() == "cublas"
    monkeypatch.setenv("TANDEM_BLAS", "cublaslt-nosplitk")
    assert blas.blas_choice() == "cublaslt-nosplitk"
    monkeypatch.setenv("TANDEM_BLAS", "cutlass")
    with pytest.raises(ValueError, match="TANDEM_BLAS='cutlass'"):
        blas.blas_choice()


def test_cpu_is_left_alone(library):
    assert blas.configure_gemms(torch.device("cpu"), "cublaslt-nosplitk") == {}
    assert library == [] and MATMUL.allow_bf16_reduced_precision_reduction_split_k


@pytest.mark.parametrize("choice,backend,splitk", [("cublas", "cublas", True),
                                                   ("cublaslt", "cublaslt", True),
                                                   ("cublaslt-nosplitk", "cublaslt", False)])
def test_cuda_settings_and_their_restore(library, choice, backend, splitk):
    before = [(getattr(MATMUL, a), getattr(MATMUL, f"{a}_split_k")) for a in blas._REDUCTIONS]
    saved = blas.configure_gemms(torch.device("cuda", 0), choice)
    try:
        assert library == [backend]
        for attr in blas._REDUCTIONS:
            assert getattr(MATMUL, f"{attr}_split_k") is splitk
            if not splitk:      # torch allows no split-K only with full-precision reductions
                assert getattr(MATMUL, attr) is False
    finally:
        blas.restore_gemms(saved)
    assert library == [backend, "cublas"]
    assert [(getattr(MATMUL, a), getattr(MATMUL, f"{a}_split_k"))
            for a in blas._REDUCTIONS] == before
