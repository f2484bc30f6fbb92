"""The seam to flash-linear-attention (FLA): the only place in the library that imports ``fla``, always inside
the function that needs it, so ``import fla_ac_isolation`` works where FLA cannot run. Importing it runs
:func:`~.install.explain_import` (on FLA 0.5.2 with Triton >= 3.9, ``import fla`` then names the Triton bound).
"""

from fla_ac_isolation.fla_seam.install import explain_import as _explain_import

_explain_import()
