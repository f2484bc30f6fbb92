"""FLA's kernels on a CPU, the public name (implemented in :mod:`fla_ac_isolation.harness.fla_seam.serving`): run
code that calls FLA's ops (your own model, or FLA's, transformers' and OLMo-core's) in a CPU test::

    with reference_kernels() as served:
        loss = model(**packed_batch).loss
        loss.backward()          # inside the block: a checkpointed layer's recompute calls FLA again
    served.calls[0].cu_seqlens   # the offsets object the first kernel call received

Imports executed inside the block (``from fla.ops.gated_delta_rule import chunk_gated_delta_rule`` in a forward)
are served too. In pytest: the fixture ``fla_reference_kernels`` (:mod:`fla_ac_isolation.harness.pytest_plugin`).
"""

from fla_ac_isolation.harness.fla_seam.serving import KernelCall, ServedKernels, reference_kernels

__all__ = ["KernelCall", "ServedKernels", "reference_kernels"]
