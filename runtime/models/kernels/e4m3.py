"""Round float32 to the nearest e4m3 value (ties to even) in float32 arithmetic, for Triton
kernels that write torch.float8_e4m3fn.

After this the cast to e4m3 is exact, so a kernel's bytes equal torch's
`.to(torch.float8_e4m3fn)` whichever conversion runs it: the GPU's rounds to nearest-even
anyway, the Triton interpreter's does not (it rounds ties away and loses the carry into the
exponent: 1.0625 -> 1.125, 127.3 -> 64), so CPU tests of FP8 kernels need this.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_rne(v):
    """float32 v, |v| <= 448 -> the e4m3 value nearest (ties to even), still float32: the
    spacing is 2^(e - 3) for exponent e >= -6, 2^-9 below (subnormals)."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    ulp = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = tl.math.div_rn(tl.abs(v), ulp)  # exact: a power of two
    r = (r + 12582912.0) - 12582912.0  # 1.5 * 2^23: rounds to an integer, RNE
    return tl.where(bits < 0, -(r * ulp), r * ulp)  # the sign, -0.0 included
