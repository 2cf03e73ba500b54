"""Our Triton kernels for the chunked SSD (Mamba-2), forward and backward: model.kernels "auto" on CUDA
(or "triton", which insists).

Same signature and semantics as models.kernels.ssd_reference.ssd_chunk_scan_ref (and mamba_ssm's
mamba_chunk_scan_combined). Triton is imported only when a kernel is first used, so a machine without
triton imports this package fine; ``triton_available()`` says whether the kernels can run.

Files: chunk_cb (C·Bᵀ per group), chunk_state (chunk states; dS_in), state_passing (the recurrence between chunks,
both directions), chained_states (the chunk states and the recurrence in one kernel, chunk handing on to chunk: the
default; and the chain's machinery), chained_dstates (the same for the backward), chunk_scan (outputs),
chunk_scan_bwd (dx, ddt, dD), dcb_bwd (dCB summed over heads, dC's state term, decay terms), db_bwd (dB's state
term), bc_finish (dB and dC from their partial sums and dCB), dt (dt's preprocessing and the gradient of dt, A and
dt_bias, one kernel each way), config (tile shapes per kernel), launch (what launchers share, and the grid order),
forward (the forward launchers), backward (the backward launchers), autograd (the Function and the entry point).
"""

from __future__ import annotations

import functools

__all__ = ["triton_available", "triton_import_error", "ssd_chunk_scan_triton"]


@functools.lru_cache(maxsize=1)
def triton_import_error() -> str | None:
    """None when triton imports, else why not."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"{type(e).__name__}: {e}"
    return None


def triton_available() -> bool:
    return triton_import_error() is None


def ssd_chunk_scan_triton(*args, **kwargs):
    """See models.kernels.ssd_triton.autograd.ssd_chunk_scan_triton (imported here on first use)."""
    err = triton_import_error()
    if err is not None:
        raise RuntimeError(
            f"the triton SSD kernels need triton ({err}); pip install triton, or use model.kernels=mamba_ssm"
        )
    from models.kernels.ssd_triton.autograd import ssd_chunk_scan_triton as fn  # lazy: imports triton

    return fn(*args, **kwargs)
