"""Imported once by the regression's forkserver so that rank processes start with the heavy modules loaded;
also silences two known warnings."""

import warnings

warnings.filterwarnings("ignore", message=".*[Aa]utocast.*")
warnings.filterwarnings("ignore", message=".*Triton is not supported.*")


import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401
import torchtitan.models.common.moe  # noqa: E402
import torchtitan.models.common.token_dispatcher  # noqa: E402,F401
import transformers  # noqa: E402,F401

from fla_ac_isolation.fla_seam.cache import cached_helpers  # noqa: E402

cached_helpers()  # imports FLA's index helpers (through the FLA seam)
