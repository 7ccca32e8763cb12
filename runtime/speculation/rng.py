"""Counter-based, stateless uniform random numbers for sampling and acceptance.

Every random number used in decoding is a pure function of (seed, absolute position, stream):
Threefry-2x32 with 20 rounds (Salmon et al., SC'11, "Parallel random numbers: as easy as
1, 2, 3"; same algorithm and test vectors as Random123 and JAX) keyed by the request's seed,
with the token position and the stream as the counter. So every TP rank, every run and every
batch composition draws identical numbers, and nothing has to be kept or synchronised.

The arithmetic is done on int64 tensors holding 32-bit words: additions are masked with
0xFFFFFFFF and rotations shift by < 32, so no intermediate reaches 2**63 and nothing relies on
signed overflow; CPU and CUDA produce bit-identical words.

Keying by *absolute position* keeps speculative decoding exact under the token rule: one
round's outcome depends only on the uniforms at positions up to its last emitted token, so the
next round may use the numbers at later positions again as fresh ones. Block verification
(runtime.speculation.acceptance.accept_block) looks at the whole window, so its outcome also
depends on the uniforms of the positions it gives back; its tests and the draft's samples under
it are keyed by the *window* instead (window_uniform): every window gets numbers of its own.
"""

from __future__ import annotations

import torch

# Streams used by the decoding loop (any int in [0, 2**16) works).
STREAM_DRAFT = 0  # the draft's own samples
STREAM_ACCEPT = 1  # rejection-sampling accept tests (`acceptance: logits`)
STREAM_TARGET = 2  # the target's samples: corrections, bonus tokens, `acceptance: tokens`
STREAM_BLOCK_DRAFT = 3  # the draft's samples under block verification (window_uniform)
STREAM_BLOCK_ACCEPT = 4  # block verification's tests eta_1..eta_k (window_uniform)

WINDOW_OFFSET_BITS = 16  # window_uniform: offsets in a window < 2**16, starts < 2**32

_M32 = 0xFFFFFFFF
_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)  # Threefry-2x32 rotation constants
_KS_PARITY = 0x1BD11BDA  # Skein key-schedule parity constant


def threefry2x32(
    k0: torch.Tensor, k1: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, rounds: int = 20
) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32 block: key (k0, k1), counter (c0, c1) -> two 32-bit words.

    All inputs are int64 tensors with values in [0, 2**32), broadcastable to a common shape;
    the outputs (that shape, int64 in [0, 2**32)) match Random123's threefry2x32_R(rounds).
    In-place ops on the two state words keep it cheap; inputs are not modified.
    """
    k0, k1, c0, c1 = torch.broadcast_tensors(k0, k1, c0, c1)
    ks = (k0, k1, k0 ^ k1 ^ _KS_PARITY)
    x0 = (c0 + k0).bitwise_and_(_M32)
    x1 = (c1 + k1).bitwise_and_(_M32)
    for r in range(rounds):
        rot = _ROTATIONS[r % 8]
        x0.add_(x1).bitwise_and_(_M32)
        high = (x1 << rot).bitwise_and_(_M32)  # x1 < 2**32, so x1 << 31 < 2**63
        x1.bitwise_right_shift_(32 - rot).bitwise_or_(high).bitwise_xor_(x0)  # rotl ^ x0
        if r % 4 == 3:  # key injection after every 4 rounds
            s = r // 4 + 1
            x0.add_(ks[s % 3]).bitwise_and_(_M32)
            x1.add_(ks[(s + 1) % 3]).add_(s).bitwise_and_(_M32)
    return x0, x1


def random_words(
    seed: torch.Tensor, position: torch.Tensor, stream: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent 32-bit words (int64 tensors [B, n]) for each (seed, position, stream).

    seed: [B] int64 (any value; the full 64 bits are used as the key)
    position: [B, n] int64, 0 <= position < 2**48
    stream: int, 0 <= stream < 2**16
    """
    if not 0 <= stream < 2**16:
        raise ValueError(f"stream must be in [0, 2**16), got {stream}")
    seed = seed.to(torch.int64)[:, None]  # [B, 1]
    position = position.to(torch.int64)  # [B, n]
    k0 = seed & _M32
    k1 = (seed >> 32) & _M32
    c0 = position & _M32
    c1 = (((position >> 32) << 16) + stream) & _M32
    return threefry2x32(k0, k1, c0, c1)


def uniform(
    seed: torch.Tensor, position: torch.Tensor, stream: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Uniforms in [0, 1) for each (seed, position, stream); a pure function of those three.

    seed: [B] int64 per-request seed
    position: [B, n] int64 absolute token positions
    stream: int, which use (STREAM_DRAFT, STREAM_ACCEPT, STREAM_TARGET, ...)
    returns [B, n] `dtype` on position's device: float64 multiples of 2**-53 (53 random bits,
            the default: inverse-CDF sampling then resolves probabilities far below 2**-24,
            which matters for large vocabularies) or float32 multiples of 2**-24; always < 1.
    """
    x0, x1 = random_words(seed, position, stream)  # [B, n] each
    if dtype == torch.float32:
        return (x0 >> 8).to(torch.float32) * 2.0**-24
    if dtype == torch.float64:
        return ((x0 << 21) | (x1 >> 11)).to(torch.float64) * 2.0**-53
    raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")


def window_uniform(
    seed: torch.Tensor, start: torch.Tensor, index: torch.Tensor, stream: int
) -> torch.Tensor:
    """Uniforms (float64, as `uniform`) keyed by the window: (seed, the window's first index,
    the offset of `index` in it, stream). A request's windows start at distinct indices, so no
    number serves two windows, whatever each window gave back.

    seed: [B] int64; start: [B] int64 first sequence index of the window (< 2**32);
    index: [B, n] int64 sequence indices, start <= index < start + 2**16
    returns [B, n] float64 in [0, 1)
    """
    start = start.to(torch.int64)[:, None]  # [B, 1]
    position = (start << WINDOW_OFFSET_BITS) | (index.to(torch.int64) - start)  # [B, n]
    return uniform(seed, position, stream)
