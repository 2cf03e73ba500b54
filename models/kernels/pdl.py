"""The first statement of every kernel of ours that fast_launch.py may launch with programmatic dependent launch
(MAMBATITAN_PDL=1; the kernel declares `PDL: tl.constexpr = False` and fast_launch sets it with Triton's launch_pdl).
Imports triton at import time: import it from the kernels' modules only.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["pdl_prologue"]


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """With PDL: wait until the kernel before on the stream has finished and its writes are visible (before any load
    or store), then let the next kernel launch once all of this one's programs have started. Without: nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
