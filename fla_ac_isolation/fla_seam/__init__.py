"""The seam to flash-linear-attention (FLA): the only place in the library that imports ``fla``.

Everything this project knows about FLA (fla-core 0.5.2 and 0.6) lives in the modules of this package:

* :mod:`~fla_ac_isolation.fla_seam.cache` - FLA's identity-keyed ``tensor_cache``: the global switch, the
  queue size, the hit/miss probe (public as :mod:`fla_ac_isolation.fla_cache`).
* :mod:`~fla_ac_isolation.fla_seam.layout` - FLA's chunk layout: :data:`~.layout.CHUNK_SIZE`, the chunk
  schedule (:func:`~.layout.chunk_indices_for`) and FLA's own index helpers, for the reference backend.
* :mod:`~fla_ac_isolation.fla_seam.features` (below) also names the modules of FLA's public entry points, which
  :mod:`fla_ac_isolation.ops` calls (its ``fla`` backend).
* :mod:`~fla_ac_isolation.fla_seam.simple_gla` - FLA's simple GLA (the Mamba2 SSD) without host syncs: its
  kernels launched with the state count read on the host, given the chunk schedule.
* :mod:`~fla_ac_isolation.fla_seam.saveable_kernels` - FLA's own forward and backward functions (and fakes) as
  the kernels of the ``fla`` backend's saveable custom operators (``ops(..., saveable=True)``).
* :mod:`~fla_ac_isolation.fla_seam.kda` - what we know of FLA's Kimi Delta Attention (``chunk_kda``): its
  key-dim limit and its index lookups as the kernel makes them (for the reference backend).
* :mod:`~fla_ac_isolation.fla_seam.versions` - the installed fla-core version, the range we test, and
  FLA's Hopper/Triton guard (its issue #640).
* :mod:`~fla_ac_isolation.fla_seam.features` - what the installed FLA supports (fla-core 0.5.2 or 0.6): where
  it keeps its conv and norm, the features that need 0.6 (:class:`~.features.FlaFeatureError` otherwise),
  and why ``import fla`` fails on an install where the metadata says so (FLA 0.5.2 with Triton >= 3.9).

What touches FLA only to run checks (the Triton-interpreter backend, FLA's kernels served by pure torch on a CPU,
FLA's model zoo) is the harness's side of the seam, ``harness/fla_seam/``; nothing here imports it.

Importing any of them imports nothing from FLA: each reaches FLA inside the function that needs it, so
``import fla_ac_isolation`` stays cheap and works where FLA's Triton kernels cannot run (a CPU). Importing
this package reads the installed metadata once (:func:`~.features.explain_import`): on FLA 0.5.2 with Triton
>= 3.9 the first ``import fla`` then fails with an ``ImportError`` naming the Triton bound.
"""

from fla_ac_isolation.fla_seam import features as _features

_features.explain_import()
