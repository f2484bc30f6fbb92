"""Public name of FLA's kernels served on a CPU: :func:`reference_kernels`, a context manager.

Inside ``with reference_kernels():`` the FLA entry points a model calls (the gated delta rule, the causal conv,
KDA, SwiGLU, the RMS norms), wherever transformers, flash-linear-attention's ``fla.layers``, OLMo-core or
torchtitan looked them up, are served by pure-torch stand-ins that ask FLA's cached index helpers as the kernels
do, so a model that calls FLA trains on a CPU and FLA's cache (and the AC fault) behaves as on a GPU::

    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    with reference_kernels() as served:
        loss = model(**packed_batch).loss   # transformers' Qwen3-Next, FLA's GatedDeltaNetForCausalLM, ...
        loss.backward()
    served.calls[0].cu_seqlens              # the offsets object the first kernel call received

The implementation lives with the rest of what this package knows about FLA, in
:mod:`fla_ac_isolation.harness.fla_seam.serving` (the binding search) and
:mod:`fla_ac_isolation.harness.fla_seam.served_ops`
(the stand-ins); this module re-exports its public names, unchanged.
"""

from fla_ac_isolation.harness.fla_seam.serving import KernelCall, ServedKernels, reference_kernels

__all__ = ["KernelCall", "ServedKernels", "reference_kernels"]
