"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels.

A CUDA-graph decode step is some 470 kernels, each a few microseconds; between two of them
the GPU drains the first grid, then launches and ramps up the second. With PDL the second
grid is launched while the first still runs (the launch attribute
cudaLaunchAttributeProgrammaticStreamSerialization, which CUDA graphs keep as programmatic
edges) and its programs wait in `griddepcontrol.wait` until the first grid has completed and
its memory is visible: the launch and ramp overlap the previous kernel's tail, the order of
memory effects stays that of the stream. Each kernel here waits before its first global
memory access and then lets its own dependents launch, so it is correct after any kernel,
PDL-launched or not (torch.compile's kernels get the same with inductor's `enable_pdl`:
runtime.models.fused.compile_kernels).

On by default where it can run (a CUDA device of compute capability 9.0 or later);
TANDEM_PDL=0 turns it off for A/B runs. Never on the CPU (the interpreter has no PDL).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def supported(device: torch.device) -> bool:
    """Whether PDL can be used on `device`: CUDA, compute capability 9.0 or later, and not
    turned off by TANDEM_PDL=0."""
    if os.environ.get("TANDEM_PDL", "1") == "0" or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(on: bool) -> dict:
    """Extra launch keywords of a kernel taking PDL: constexpr: Triton's launch_pdl flag."""
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def wait_and_release(PDL: tl.constexpr):
    """Before a kernel's first global memory access: wait for the grid before it, then let
    the next grid launch (it waits in turn). Nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
