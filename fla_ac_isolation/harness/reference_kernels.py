"""Public name of FLA's kernels served on a CPU (:mod:`fla_ac_isolation.harness.fla_seam.serving`)::

    with reference_kernels() as served:
        loss = model(**packed_batch).loss
        loss.backward()
    served.calls[0].cu_seqlens   # the offsets object the first kernel call received
"""

from fla_ac_isolation.harness.fla_seam.serving import KernelCall, ServedKernels, reference_kernels

__all__ = ["KernelCall", "ServedKernels", "reference_kernels"]
