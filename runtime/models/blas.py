"""The cuBLAS settings of the GEMMs a worker runs on CUDA, chosen by TANDEM_BLAS:

    cublas             torch's default (cuBLAS for bf16/fp16 GEMMs)
    cublaslt           torch's cuBLASLt backend (torch.backends.cuda.preferred_blas_library)
    cublaslt-nosplitk  cuBLASLt without split-K reductions in bf16/fp16 GEMMs: no separate
                       reduction kernel after a decode GEMM
                       (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)

FP8 GEMMs (torch._scaled_mm) always run on cuBLASLt. examples/gpu/step_ab.py measures the
settings against each other on a decode step (docs/benchmarks.md).
"""
from __future__ import annotations

import os

import torch

CHOICES = ("cublas", "cublaslt", "cublaslt-nosplitk")
_REDUCTIONS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


def blas_choice() -> str:
    """TANDEM_BLAS (default cublas); anything else is an error naming the variable."""
    choice = os.environ.get("TANDEM_BLAS", "cublas")
    if choice not in CHOICES:
        raise ValueError(f"TANDEM_BLAS={choice!r}: expected one of {', '.join(CHOICES)}")
    return choice


def configure_gemms(device: torch.device, choice: str | None = None) -> dict:
    """Apply `choice` (default: blas_choice()) for GEMMs on `device` (nothing on CPU). Returns
    the settings it replaced, for restore_gemms."""
    choice = blas_choice() if choice is None else choice
    if device.type != "cuda":
        return {}
    matmul = torch.backends.cuda.matmul
    saved = {"library": torch.backends.cuda.preferred_blas_library(),
             **{attr: (getattr(matmul, attr), getattr(matmul, f"{attr}_split_k"))
                for attr in _REDUCTIONS}}
    torch.backends.cuda.preferred_blas_library("cublas" if choice == "cublas" else "cublaslt")
    if choice == "cublaslt-nosplitk":
        for attr in _REDUCTIONS:
            setattr(matmul, attr, (False, False))
    return saved


def restore_gemms(saved: dict) -> None:
    """Undo configure_gemms."""
    if not saved:
        return
    torch.backends.cuda.preferred_blas_library(saved["library"])
    for attr in _REDUCTIONS:
        setattr(torch.backends.cuda.matmul, attr, saved[attr])
