"""Weights read into L2 ahead of their GEMM, on a side stream, while small kernels run (Triton).

A decode step alternates GEMMs, which stream their weights from memory at close to its
bandwidth, with small kernels (norms, RoPE, attention over a short cache, SiLU·up), during
which memory is almost idle. Each GEMM found its weights in L2 ran 2-3 µs faster on the 8b
decode shapes of an H200 (docs/benchmarks.md, "Weights found in L2"). So after each GEMM is
launched the model asks for the next GEMM's weights (`ahead`): a kernel on a side stream,
ordered after everything launched so far on the model's stream, reads up to CAPS_MB[kind]
of them with L2-only loads (`.cg`) while the model's stream runs the small kernels (in CUDA
graph captures only: an eager step would pay a launch's host time for each); `join` at
the end of the forward makes the model's stream wait for the side stream (a CUDA graph's
capture must end joined). The GEMM does not wait for its prefetch: lines still in flight are
merged in L2, and a prefetch that falls behind only costs bandwidth the GEMM would have used.

The kernel sums the words it reads into `sink` (one int32 a program), so the loads cannot be
optimised away and a test can check that every word of the range was read. Off by default
(TANDEM_L2_PREFETCH=1 turns it on, read by runtime.models.arch.kernels, which calls `ahead` and
`join` only while the kernels are enabled; examples/gpu/step_ab.py's `l2*` modes measure it);
on the CPU under the Triton interpreter the kernel runs inline.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# MB of each GEMM's weights read ahead (0: none); kind: the GEMM the weights belong to. On an
# H200 only the gap before o_proj (RoPE, attention) is long enough to pay: reading ahead in
# the others measured 13-47% slower steps, and more than ~12 MB slower in bf16
CAPS_MB = {"qkv": 0.0, "o": 12.0, "gate_up": 0.0, "down": 0.0}
PROGRAMS = 32          # programs of one prefetch: a few multiprocessors, the rest stay free
BLOCK = 8192           # int32 words a program loads per iteration (32 KB in flight)
_streams: dict[torch.device, torch.cuda.Stream] = {}
_sinks: dict[torch.device, torch.Tensor] = {}
_forked: set[torch.device] = set()     # devices whose side stream has work since the last join
_warm: set[torch.device] = set()       # devices the kernel was compiled for


@triton.jit
def _prefetch_kernel(src_ptr, sink_ptr, n_words, words_per_prog, BLOCK: tl.constexpr):
    """Program p reads words [p * words_per_prog, (p + 1) * words_per_prog) of src (int32)
    through L2 only and stores their int32 (wrapping) sum at sink[p]."""
    pid = tl.program_id(0)
    start = pid * words_per_prog
    stop = tl.minimum(start + words_per_prog, n_words)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for base in range(start, stop, BLOCK):
        idx = base + offs
        acc += tl.load(src_ptr + idx, mask=idx < stop, other=0, cache_modifier=".cg")
    tl.store(sink_ptr + pid, tl.sum(acc, axis=0))


def words(weight: torch.Tensor, cap_bytes: int) -> torch.Tensor:
    """The first min(cap_bytes, all) bytes of a contiguous weight as int32 words."""
    flat = weight.detach().reshape(-1).view(torch.uint8)
    n = min(flat.numel(), int(cap_bytes)) // 4 * 4
    return flat[:n].view(torch.int32)


def read(src: torch.Tensor, sink: torch.Tensor, programs: int | None = None) -> None:
    """Launch the prefetch of int32 words src on the current stream; sink [programs] int32
    (default PROGRAMS)."""
    n, programs = src.numel(), programs or PROGRAMS
    if n == 0:
        return
    per_prog = triton.cdiv(triton.cdiv(n, programs), BLOCK) * BLOCK
    grid = (triton.cdiv(n, per_prog),)
    _prefetch_kernel[grid](src, sink, n, per_prog, BLOCK=BLOCK, num_warps=8)


def _sink(device: torch.device) -> torch.Tensor:
    if device not in _sinks:
        _sinks[device] = torch.zeros(PROGRAMS, dtype=torch.int32, device=device)
    return _sinks[device]


def cap_bytes(kind: str, device: torch.device) -> int:
    """CAPS_MB[kind] in bytes, at most three quarters of the device's L2."""
    cap = CAPS_MB.get(kind, 0.0) * 2**20
    if device.type == "cuda":
        cap = min(cap, 0.75 * torch.cuda.get_device_properties(device).L2_cache_size)
    return int(cap)


def ahead(weight: torch.Tensor, kind: str) -> None:
    """Read the first CAPS_MB[kind] of `weight` into L2 behind the work launched so far, on
    the side stream, while a CUDA graph is being captured (on the CPU inline, always);
    nothing when the cap is 0."""
    device = weight.device
    cuda = device.type == "cuda"
    capturing = cuda and torch.cuda.is_current_stream_capturing()
    # eager CUDA steps only compile the kernel (once); a capture before that reads nothing
    if not weight.is_contiguous() or cuda and (capturing != (device in _warm)):
        return
    src = words(weight, cap_bytes(kind, device))
    if src.numel() == 0:
        return
    if not cuda:
        read(src, _sink(device))
    elif not capturing:                        # compile outside a capture, once
        read(src[:BLOCK], _sink(device))
        _streams.setdefault(device, torch.cuda.Stream(device))
        _warm.add(device)
    else:
        main, side = torch.cuda.current_stream(device), _streams[device]
        side.wait_stream(main)                 # after the GEMM just launched
        with torch.cuda.stream(side):
            read(src, _sink(device))
        _forked.add(device)


def join(device: torch.device) -> None:
    """The current stream waits for the prefetches since the last join (a graph capture
    must end with its side stream joined)."""
    if device in _forked:
        _forked.discard(device)
        torch.cuda.current_stream(device).wait_stream(_streams[device])
